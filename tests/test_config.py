"""config.py + main.py's error path: the YAML equals the
dataclass defaults and comments every key, dotted overrides are typed, and every bad input is
one line on stderr, exit code 2, no traceback, with an existing snapshot left as it was.

Most bad inputs run in-process through `main.main([...])` (milliseconds each); two go through a
real `python main.py` to prove the subprocess contract (no traceback, exit status 2). The keys of
parallel.* that belong to one strategy and wandb.* are tested next to their code
(tests/test_parallel_*.py, tests/test_tracking.py)."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

import main as app
from checks import load_config
from config import Config, redact_url
from testing.local import REPO, TINY, python

YAML_PATH = REPO / "gpt2_train_cfg.yaml"


def test_yaml_equals_dataclass_defaults_and_comments_every_key():
    from_yaml = yaml.safe_load(YAML_PATH.read_text(encoding="utf-8"))
    defaults = Config().to_dict()
    assert from_yaml.keys() == defaults.keys()
    for section, body in defaults.items():
        assert from_yaml[section].keys() == body.keys(), section
        for key, value in body.items():
            got = from_yaml[section][key]
            got = got if got is not None else ""
            assert got == value or (isinstance(value, float) and float(got) == value), \
                f"{section}.{key}: yaml {got!r} != dataclass {value!r}"
    # and loading the file changes nothing
    assert load_config(str(YAML_PATH)).to_dict() == defaults
    section = None
    uncommented = []
    for line in YAML_PATH.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^(\w+):\s*(#.*)?$", line):
            section = m.group(1)
        elif m := re.match(r"^  (\w+):", line):
            if not re.search(r"\s#\s*\S", line):
                uncommented.append(f"{section}.{m.group(1)}")
    assert not uncommented, f"keys without a comment in {YAML_PATH.name}: {uncommented}"


def test_dotted_overrides_are_typed():
    cfg = load_config(str(YAML_PATH), [
        "trainer.max_steps=7", "optimizer.lr=3e-4", "optimizer.min_lr=1e-5", "model.bias=false",
        "trainer.max_epochs=2", "wandb.tags=a,b", "data.path=123", "data.sha256=", "model.dropout=0.1",
        "trainer.batch_size=24.0"])
    assert cfg.trainer.max_steps == 7 and type(cfg.trainer.max_steps) is int
    assert cfg.optimizer.lr == 3e-4 and type(cfg.optimizer.lr) is float  # YAML 1.1 reads "3e-4" as str
    assert cfg.model.bias is False and cfg.trainer.max_epochs == 2.0 and type(cfg.trainer.max_epochs) is float
    assert cfg.wandb.tags == ["a", "b"] and cfg.data.path == "123" and cfg.data.sha256 == ""
    assert cfg.trainer.batch_size == 24 and type(cfg.trainer.batch_size) is int
    # a later override wins; the other sections keep the file's values
    assert load_config(None, ["trainer.seed=1", "trainer.seed=2"]).trainer.seed == 2
    assert cfg.model.n_layer == Config().model.n_layer


# ----------------------------------------------------------------------------- bad input


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    """A run folder holding a snapshot, which no bad input may touch; plus bad input files."""
    root = tmp_path_factory.mktemp("bad-input")
    run = root / "run"
    assert app.main(TINY + ["parallel.strategy=none", "trainer.max_steps=2", "trainer.save_every=2",
                            "trainer.sample_tokens=0", f"trainer.run_dir={run}"]) == 0
    assert (run / "snapshots" / "step_0000002" / "meta.json").is_file()
    (root / "empty.txt").write_text("   \n")
    (root / "latin1.txt").write_bytes("Roméo et Juliette\n".encode("latin-1") * 100)
    (root / "short.txt").write_text("First Citizen:\n")
    (root / "bad.yaml").write_text("trainer:\n  max_steps: [1, 2\n")
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "a_file").write_text("not a folder")
    return root, run, digests(run)


# (overrides, words the one-line message must contain). "{root}" is the fixture's folder.
BAD_INPUTS = {
    # a data file that cannot be read as a corpus
    "missing data file": (["data.path={root}/nope.txt"], "does not exist"),
    "data path is a folder": (["data.path={root}"], "is a folder"),
    "empty data file": (["data.path={root}/empty.txt"], "is empty"),
    "non-UTF-8 data file": (["data.path={root}/latin1.txt"], "is not UTF-8"),
    "corpus shorter than a block": (["data.path={root}/short.txt"], "too short for model.block_size"),
    "malformed YAML": (["--config", "{root}/bad.yaml"], "is not valid YAML at line"),
    "YAML not a mapping": (["--config", "{root}/list.yaml"], "must be a mapping"),
    "missing config file": (["--config", "{root}/none.yaml"], "not found"),
    "unknown key": (["trainer.max_step=5"], "did you mean 'trainer.max_steps'"),
    "unknown section": (["trainr.max_steps=5"], "did you mean 'trainer'"),
    "not section.key": (["max_steps=5"], "must look like section.key"),
    "override without =": (["trainer.max_steps"], "must look like section.key=value"),
    "wrong type int": (["trainer.max_steps=many"], "must be an integer"),
    "wrong type float": (["optimizer.lr=fast"], "must be a number"),
    "wrong type bool": (["model.bias=maybe"], "must be true or false"),
    "wrong type str": (["data.tokenizer=[a]"], "must be a string"),
    "n_embd % n_head": (["model.n_embd=30", "model.n_head=4"], "not divisible by model.n_head"),
    "micro batch does not divide": (["trainer.batch_size=8", "trainer.micro_batch_size=3"],
                                    "does not divide the per-rank batch"),
    "run_dir is a file": (["trainer.run_dir={root}/a_file"], "is a file"),
    "run_dir under a file": (["trainer.run_dir={root}/a_file/run"], "(Not a directory"),
    "run_dir under /proc": (["trainer.run_dir=/proc/mingpt-run/x"], "cannot create or write trainer.run_dir"),
    # every other validated key of data/model/trainer/optimizer and the layout-wide parallel keys
    "tokenizer": (["data.tokenizer=bpe"], "not one of char, gpt2"),
    "sha256": (["data.sha256=abc"], "data.sha256"),
    "cache_dir a file": (["data.path=http://127.0.0.1:9/x.txt", "data.cache_dir={root}/a_file"],
                         "data.cache_dir"),
    "cache_dir empty": (["data.cache_dir="], "data.cache_dir"),
    "truncate": (["data.truncate=-1"], "data.truncate must be >= 0"),
    "val_fraction": (["data.val_fraction=1.5"], "between 0 and 1"),
    "empty path": (["data.path="], "data.path is empty"),
    "redacted URL": (["data.path=http://reader:***@127.0.0.1:9/c.txt?token=***"], "holds redacted credentials"),
    "offline_fallback": (["data.offline_fallback=maybe"], "data.offline_fallback' must be true or false"),
    "val_path without a .bin": (["data.val_path={root}/val.bin"], "data.val_path only applies when data.path"),
    "val_path not a .bin": (["data.path={root}/train.bin", "data.tokenizer=gpt2", "data.truncate=0",
                             "data.val_path={root}/val.txt"], "data.val_path='"),
    ".bin with the char tokenizer": (["data.path={root}/train.bin", "data.truncate=0", "data.tokenizer=char"], "set data.tokenizer=gpt2"),
    "truncate with a token corpus": (["data.path={root}/train.bin", "data.tokenizer=gpt2"],
                                     "data.truncate counts characters of a text corpus"),
    "val_fraction with a token corpus": (["data.path={root}/train.bin", "data.tokenizer=gpt2", "data.truncate=0",
                                          "data.val_fraction=0.2"], "data.val_fraction splits a text corpus"),
    "n_layer": (["model.n_layer=0"], "model.n_layer must be > 0"),
    "n_head": (["model.n_head=0"], "model.n_head must be > 0"),
    "block_size": (["model.block_size=-4"], "model.block_size must be > 0"),
    "dropout": (["model.dropout=1.0"], "model.dropout must be in [0, 1)"),
    "gelu": (["model.gelu=relu"], "model.gelu='relu' is not one of erf, tanh"),
    "activation": (["model.activation=swish"], "model.activation='swish' is not one of gelu, relu2"),
    "qk_norm": (["model.qk_norm=maybe"], "model.qk_norm"),
    "zero_init_proj": (["model.zero_init_proj=2"], "model.zero_init_proj"),
    "init_from missing": (["model.init_from={root}/nope.pt"], "model.init_from '"),
    "max_steps": (["trainer.max_steps=0"], "trainer.max_steps must be > 0"),
    "max_epochs": (["trainer.max_epochs=-1"], "trainer.max_epochs must be >= 0"),
    "batch_size": (["trainer.batch_size=0"], "trainer.batch_size must be > 0"),
    "micro_batch_size": (["trainer.micro_batch_size=-2"], "trainer.micro_batch_size must be >= 0"),
    "eval_every": (["trainer.eval_every=-1"], "trainer.eval_every must be >= 0"),
    "eval_batches": (["trainer.eval_batches=0"], "trainer.eval_batches must be > 0"),
    "log_every": (["trainer.log_every=0"], "trainer.log_every must be > 0"),
    "keep_snapshots": (["trainer.keep_snapshots=0"], "trainer.keep_snapshots must be > 0"),
    "save_every": (["trainer.save_every=-1"], "trainer.save_every must be >= 0"),
    "sample_tokens": (["trainer.sample_tokens=-1"], "trainer.sample_tokens must be >= 0"),
    "grad_clip": (["trainer.grad_clip=-1"], "trainer.grad_clip must be >= 0"),
    "peak_flops": (["trainer.peak_flops=-1"], "trainer.peak_flops must be >= 0"),
    "attention": (["trainer.attention=flash"], "trainer.attention='flash' is not one of sdpa, matmul"),
    "host_memory": (["trainer.host_memory=keep"], "trainer.host_memory='keep' is not one of lean, reuse"),
    "compile_scope": (["trainer.compile_scope=all"], "trainer.compile_scope='all' is not one of blocks, model"),
    "compile_scope=model without compile": (["trainer.compile_scope=model", "parallel.strategy=none"],
                                            "compiles nothing without trainer.compile=true"),
    "compile_scope=model with an engine": (["trainer.compile=true", "trainer.compile_scope=model"],
                                           "and parallel.strategy=ddp works on single blocks"),
    "compile_scope=model with pp": (["trainer.compile=true", "trainer.compile_scope=model", "parallel.strategy=none",
                                     "parallel.pp=2"], "and parallel.pp=2 works on single blocks"),
    "compile_scope=model with recomputation": (["trainer.compile=true", "trainer.compile_scope=model",
                                                "parallel.strategy=none", "parallel.activation_checkpointing=true"],
                                               "and parallel.activation_checkpointing=true works on single blocks"),
    "hang_timeout_s": (["trainer.hang_timeout_s=-5"], "trainer.hang_timeout_s must be >= 0"),
    "async_save": (["trainer.async_save=maybe"], "trainer.async_save' must be true or false"),
    "profile": (["trainer.profile=10"], "trainer.profile='10' is not START:STEPS"),
    "profile steps": (["trainer.profile=10:0"], "is not START:STEPS (two whole numbers, STEPS >= 1)"),
    "resume": (["trainer.resume=maybe"], "not one of auto, never, require"),
    "precision": (["trainer.precision=fp8"], "not one of fp32, bf16, fp16, auto"),
    "device": (["trainer.device=tpu"], "not one of auto, cpu, cuda"),
    "cuda without a GPU": (["trainer.device=cuda"], "no CUDA device; run it on a GPU machine, or give the "
                                                    "override trainer.device=cpu"),
    "GPU preset without a GPU": (["--config", str(REPO / "presets" / "gpu_8x8x512.yaml")],
                                 "gpu_8x8x512.yaml sets trainer.device: cuda (a GPU config) but torch"),
    "--dotted override": (["--trainer.max_steps=20"], "written without leading dashes, as trainer.max_steps=20"),
    "--dotted override, value apart": (["--trainer.max_steps", "20"], "dashes, as trainer.max_steps=20"),
    "nanoGPT's --key=value": (["--max_steps=20"], "config overrides are written section.key=value, without "
                                                  "dashes, as trainer.max_steps=20"),
    "nanoGPT's --key value": (["--max-steps", "20"], "without dashes, as trainer.max_steps=20"),
    "empty run_dir": (["trainer.run_dir="], "trainer.run_dir is empty"),
    "compile": (["trainer.compile=2"], "must be true or false"),
    "lr": (["optimizer.lr=0"], "optimizer.lr must be > 0"),
    "min_lr above lr": (["optimizer.min_lr=0.1"], "is above optimizer.lr"),
    "min_lr": (["optimizer.min_lr=-1e-4"], "optimizer.min_lr must be >= 0"),
    "warmup_steps": (["optimizer.warmup_steps=-1"], "optimizer.warmup_steps must be >= 0"),
    "lr_decay_steps": (["optimizer.lr_decay_steps=-1"], "optimizer.lr_decay_steps must be >= 0"),
    "weight_decay": (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay must be >= 0"),
    "beta1": (["optimizer.beta1=1.0"], "optimizer.beta1 must be in [0, 1)"),
    "beta2": (["optimizer.beta2=-0.1"], "optimizer.beta2 must be in [0, 1)"),
    "optimizer name": (["optimizer.name=sgd"], "optimizer.name"),
    "muon sliced": (["optimizer.name=muon", "parallel.strategy=zero", "parallel.zero_stage=2"],
                    "optimizer.name=muon orthogonalises whole matrices and ZeRO-2 keeps flat slices"),
    "muon auto": (["optimizer.name=muon", "parallel.strategy=auto"], "parallel.strategy=auto plans AdamW's state only"),
    "strategy": (["parallel.strategy=fsdp2"], "did you mean 'fsdp'"),
    "tp": (["parallel.tp=0"], "parallel.tp must be > 0"),
    "pp": (["parallel.pp=0"], "parallel.pp must be > 0"),
    "n_head % tp": (["parallel.tp=3"], "not divisible by parallel.tp=3"),
    "world size vs tp": (["parallel.tp=2"], "world size 1 is not divisible"),
    "strategy-only option": (["parallel.strategy=none", "parallel.zero_stage=2"], "only applies to"),
    "dp_replicate": (["parallel.strategy=fsdp", "parallel.dp_replicate=0"], "parallel.dp_replicate must be > 0"),
    "dp_replicate without fsdp": (["parallel.strategy=ddp", "parallel.dp_replicate=2"],
                                  "parallel.dp_replicate only applies to parallel.strategy=fsdp"),
    "pp-only option": (["parallel.pp_schedule=gpipe"], "only applies with parallel.pp > 1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_touches_no_snapshot(case, existing_run, capsys, monkeypatch):
    root, run, before = existing_run
    overrides, words = BAD_INPUTS[case]
    args = [a.format(root=root) for a in overrides]
    capsys.readouterr()
    # Bad input is the device's business only in the "without a GPU" cases: on a GPU machine (a
    # MINGPT_TEST_DEVICE=cuda session) this process sees none too, and trainer.device is left to them.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    any_device = [a for a in TINY if not a.startswith("trainer.device=")]
    # max_steps=1: a case that wrongly passed validation would resume at step 2 and train nothing
    rc = app.main(any_device + ["trainer.max_steps=1", "trainer.sample_tokens=0", f"trainer.run_dir={run}"]
                  + args)  # the case's own overrides come last and win; argparse takes --config anywhere
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2, f"{case}: exit {rc}, stderr {err!r}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: {err!r}"
    assert words in lines[0], f"{case}: {lines[0]!r} lacks {words!r}"
    assert digests(run) == before, f"{case} changed the existing run folder"


@pytest.mark.launch
@pytest.mark.parametrize("overrides, words", [
    (["--config", "{root}/bad.yaml"], "is not valid YAML"),
    (["data.path={root}/latin1.txt"], "is not UTF-8"),
])
def test_bad_input_through_python_main_py(overrides, words, existing_run):
    root, run, before = existing_run
    args = [a.format(root=root) for a in overrides]
    r = python(["main.py", *TINY, f"trainer.run_dir={run}", *args], timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert digests(run) == before



@pytest.mark.parametrize("url, shown", [
    ("https://reader:pw@host:8/c.txt?v=1&token=t0k", "https://reader:***@host:8/c.txt?v=1&token=***"),
    ("https://ghp_T0KEN@github.com/a/b.txt", "https://***@github.com/a/b.txt"),
    ("https://b.s3.amazonaws.com/f?X-Amz-Credential=AK&X-Amz-Signature=ab&X-Amz-Date=1",
     "https://b.s3.amazonaws.com/f?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Date=1"),
    ("from https://h/f?sig=s1&api_key=k2#top (cached at /c)", "from https://h/f?sig=***&api_key=***#top (cached at /c)"),
    ("https://raw.githubusercontent.com/karpathy/char-rnn/master/input.txt?raw", None),
    ("/data/corpus.txt", None),
])
def test_redact_url_hides_credentials_and_keeps_the_rest(url, shown):
    assert redact_url(url) == (shown or url)
    cfg = load_config(None, [f"data.path={url}"] if url.startswith("https://") else [])
    if url.startswith("https://"):
        assert cfg.data.path == url and cfg.to_dict()["data"]["path"] == (shown or url)


def test_every_blocker_of_a_launch_in_one_line_world_size_first(tmp_path, capsys, monkeypatch):
    """torchrun --nproc_per_node=4 main.py parallel.strategy=fsdp parallel.tp=3: the world size
    (4 is no multiple of tp x pp = 3) and the heads (4 do not split over tp=3) are both named, the
    world size first, in the one error line: fixing the heads must not reveal the world size."""
    monkeypatch.setenv("WORLD_SIZE", "4")  # what torchrun sets; the config is refused before any group
    assert app.main(TINY + ["parallel.strategy=fsdp", "parallel.tp=3", f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: 2 problems: (1) world size 4 is not divisible by "
                                                   "parallel.tp * parallel.pp = 3"), err
    assert "(2) model.n_head=4 is not divisible by parallel.tp=3" in err, err
    assert not (tmp_path / "run").exists()


def test_a_string_key_keeps_an_override_as_typed():
    """YAML 1.1 reads 3:2 as the base-60 number 182: a string key takes the text itself."""
    cfg = load_config(None, ["trainer.profile=3:2", "trainer.run_dir=0x10"])
    assert cfg.trainer.profile == "3:2" and cfg.trainer.run_dir == "0x10"


def test_model_fingerprint_holds_what_the_weights_compute_not_how_they_start():
    # a snapshot resumes only into the same function: the activation and QK-norm change it (a
    # resume with another one is refused), zero_init_proj only the start; a key at the value every
    # run had before it existed leaves the hash of those runs' snapshots unchanged
    def fingerprint(*overrides):
        return load_config(None, list(overrides)).model_fingerprint()
    base = fingerprint()
    assert fingerprint("model.zero_init_proj=true") == base
    assert len({base, fingerprint("model.activation=relu2"), fingerprint("model.qk_norm=true")}) == 3
    shape = {k: v for k, v in Config().to_dict()["model"].items()
             if k not in ("dropout", "init_from", "size", "gelu", "activation", "qk_norm", "zero_init_proj")}
    before = hashlib.sha256(json.dumps({**shape, "tokenizer": "char"}, sort_keys=True).encode())
    assert base == before.hexdigest()[:16]
