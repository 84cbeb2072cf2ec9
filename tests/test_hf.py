"""GPT-2 weights in and out, and fine-tuning from a finished run, against
the real `transformers` library with no download: a small random GPT2LMHeadModel imported with
model.init_from gives its logits; our runs exported with `export.py --format hf` load in
transformers with our logits; a fine-tune of the import under fsdp and tp=2 starts from the
imported loss; model.init_from=<run>/model.pt starts a new run from a finished one; mismatched
or damaged sources are refused with one line, exit 2, and no run folder is created.

Launches: one 2-process tests/app_worker.py (fsdp and tp=2); the rest runs in this process."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import GPT2Config, GPT2LMHeadModel

import export
import main as app
from char_dataset import Batching, CharDataset
from checks import load_config
from corpus.text import load_corpus
from corpus.tokenizers import tokenizer_from_dict
from launch.build import build_trainer
from parallel.env import init_distributed
from testing.local import TINY, torchrun
from weights.model_file import read_model_file
from weights.pretrained import adopt_model_shape

# A GPT-2 of the test size: 2 blocks, 2 heads (tp=2 splits them), the GPT-2 vocabulary.
HF_SHAPE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
# The same shape as overrides; block_size 16 < n_positions 64 exercises the position crop.
GPT2_RUN = ["data.tokenizer=gpt2", "model.n_layer=2", "model.n_head=2", "model.gelu=tanh",
            "trainer.log_every=1", "trainer.sample_tokens=0"]


def load_model_pt(path):
    """(model, tokenizer, payload) of a model.pt, as sample.py reads it."""
    model_file = read_model_file(path)
    return model_file.build_model(), tokenizer_from_dict(model_file.tokenizer), model_file.payload()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[Path, GPT2LMHeadModel]:
    """A random GPT-2 saved as save_pretrained writes it. The weights are drawn far wider than
    GPT-2's init (std 0.02), so a wrong mapping, transpose or GELU form moves the logits by far
    more than the tolerance."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**HF_SHAPE))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.eval()
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    model.save_pretrained(path)
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    return path, model


def ours(run_dir: Path, overrides: list[str]):
    """The model and data a launch with these overrides starts from (one process, no training), on
    the CPU beside Hugging Face's, whatever device the session built it on."""
    cfg = load_config(None, TINY + [f"trainer.run_dir={run_dir}"] + overrides)
    trainer = build_trainer(cfg, init_distributed(cfg), run_dir)
    return trainer.strategy.model.eval().cpu(), trainer


def hf_loss(model, x, y) -> float:
    with torch.no_grad():
        logits = model(x).logits
    return float(F.cross_entropy(logits.flatten(0, 1), y.flatten()))


def digests(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def first_logged_loss(run_dir: Path) -> dict:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if "loss" in r)


def test_import_hf_gpt2_gives_its_logits(hf_dir, tmp_path):
    path, hf = hf_dir
    model, _ = ours(tmp_path / "run", GPT2_RUN + [f"model.init_from={path}"])
    ids = torch.randint(0, 50257, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    # the check can tell the GELU forms apart: with the exact GELU the logits miss the tolerance
    for block in model.blocks.values():
        block.mlp.gelu_approximate = "none"
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() > 10 * 1e-5


@pytest.mark.launch
def test_finetune_imported_gpt2_under_fsdp_and_tp_starts_from_its_loss(hf_dir, tmp_path):
    path, hf = hf_dir
    common = GPT2_RUN + [f"model.init_from={path}", "trainer.max_steps=3"]
    runs = {"fsdp": "parallel.strategy=fsdp", "tp": "parallel.tp=2"}
    args = []
    for name, layout in runs.items():
        args += ["--app", " ".join(TINY + common + [layout, f"trainer.run_dir={tmp_path / name}"])]
    r = torchrun(2, ["tests/app_worker.py", "--out", str(tmp_path), *args], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert json.loads((tmp_path / "exit_codes.json").read_text()) == [0, 0]
    # the imported model's loss on the batch of step 0 (the same corpus, tokenizer and data order)
    _, trainer = ours(tmp_path / "reference", common)
    x, y = trainer.data.train_batch(0, Batching(trainer.cfg.trainer.batch_size))
    want = hf_loss(hf, x, y)
    assert r.stdout.count(f"weights from {path}") == 2  # one start-up line per run
    for name in runs:
        row = first_logged_loss(tmp_path / name)
        assert row["step"] == 1 and abs(row["loss"] - want) <= 1e-4, (name, row["loss"], want)


@pytest.mark.parametrize("variant", ["char", "gpt2_untied_no_bias"])
def test_export_hf_loads_in_transformers_with_our_logits(variant, tmp_path):
    """A short trained run exported as a Hugging Face folder; char models carry their vocabulary
    (mingpt_tokenizer.json); bias=False models get zero biases (the same function); an untied LM
    head is written as lm_head.weight. Then the exported folder is imported back with
    model.init_from: the same weights again."""
    extra = {"char": [], "gpt2_untied_no_bias": ["data.tokenizer=gpt2", "model.n_layer=2", "model.bias=false",
                                                 "model.tie_weights=false", "model.gelu=tanh"]}[variant]
    run = tmp_path / "run"
    assert app.main(TINY + extra + ["parallel.strategy=none", "trainer.max_steps=3", "trainer.sample_tokens=0",
                                    f"trainer.run_dir={run}"]) == 0
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(run), "--format", "hf", "--out", str(out)]) == 0
    model, tok, payload = load_model_pt(run / "model.pt")
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.vocab_size == tok.vocab_size and hf.config.n_positions == 16
    record = json.loads((out / "mingpt_tokenizer.json").read_text())
    assert record == payload["tokenizer"]
    ids = torch.randint(0, tok.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids)
        assert (hf(ids).logits - want).abs().max().item() <= 1e-5
    # and back: the exported folder starts a new run with the same weights and tokenizer
    back, trainer = ours(tmp_path / "again", extra + ["model.bias=true", f"model.init_from={out}"])
    assert trainer.tokenizer.to_dict() == payload["tokenizer"]
    with torch.no_grad():
        assert (back(ids) - want).abs().max().item() <= 1e-5


def test_export_hf_refuses_what_gpt2_cannot_express(tmp_path, capsys):
    # ReLU^2 and QK-norm have no GPT-2 config field: a GPT-2 folder of these weights would load in
    # transformers and silently compute another function; one line, exit 2, nothing written
    run = tmp_path / "run"
    assert app.main(TINY + ["model.activation=relu2", "model.qk_norm=true", "parallel.strategy=none",
                            "trainer.max_steps=2", "trainer.sample_tokens=0", f"trainer.run_dir={run}"]) == 0
    capsys.readouterr()
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(run), "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.activation=relu2 qk_norm=true" in err and "--format pt" in err, err
    assert not out.exists()


def test_init_from_model_pt_starts_a_new_run_and_a_resume_ignores_it(tmp_path, capsys):
    first = tmp_path / "first"
    assert app.main(TINY + ["parallel.strategy=none", "trainer.max_steps=4", "trainer.sample_tokens=0",
                            f"trainer.run_dir={first}"]) == 0
    model, tok, _ = load_model_pt(first / "model.pt")
    second = tmp_path / "second"
    launch = TINY + ["parallel.strategy=none", "trainer.sample_tokens=0", "trainer.log_every=1",
                     f"model.init_from={first / 'model.pt'}", f"trainer.run_dir={second}"]
    capsys.readouterr()
    assert app.main(launch + ["trainer.max_steps=2"]) == 0
    assert f"weights from {first / 'model.pt'}" in capsys.readouterr().out
    # the new run's first step trains the finished run's model: its loss on batch 0
    cfg = load_config(None, launch)
    text, _ = load_corpus(cfg.data)
    data = CharDataset(tok.encode(text), cfg.model.block_size, cfg.data.val_fraction, cfg.trainer.seed)
    x, y = data.train_batch(0, Batching(cfg.trainer.batch_size))
    with torch.no_grad():
        want = float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    row = first_logged_loss(second)
    assert row["step"] == 1 and abs(row["loss"] - want) <= 1e-4, (row, want)
    # a relaunch of the same command resumes its own snapshot: init_from only starts a run
    assert app.main(launch + ["trainer.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "weights from" not in out
    steps = [json.loads(l)["step"] for l in (second / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == [1, 2, 3]
    # the finished run's model_config and tokenizer record must agree with the new run's config
    for wrong, words in ((["model.n_embd=64"], "model.n_embd=32 (config: 64)"),
                         (["data.tokenizer=gpt2"], "was trained with the char tokenizer but data.tokenizer=gpt2")):
        third = tmp_path / "third"
        assert app.main(launch[:-1] + [f"trainer.run_dir={third}"] + wrong) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
        assert not third.exists()
    # every snapshot damaged: no resume, and no silent start over from init_from either
    for meta in (second / "snapshots").glob("step_*/meta.json"):
        meta.write_text(meta.read_text()[:-20])
    before = digests(second)
    capsys.readouterr()
    assert app.main(launch + ["trainer.max_steps=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "holds no valid snapshot to resume" in err[-1], err
    assert digests(second) == before


@pytest.fixture(scope="module")
def bad_sources(hf_dir, tmp_path_factory) -> Path:
    path, _ = hf_dir
    root = tmp_path_factory.mktemp("bad-sources")
    for name in ("truncated", "llama", "eps", "bin_only"):
        shutil.copytree(path, root / name)
    st = root / "truncated" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    for name, key, value in (("llama", "model_type", "llama"), ("eps", "layer_norm_epsilon", 1e-6)):
        cfg = json.loads((root / name / "config.json").read_text())
        cfg[key] = value
        (root / name / "config.json").write_text(json.dumps(cfg))
    (root / "bin_only" / "model.safetensors").unlink()
    (root / "garbage.pt").write_bytes(b"\x80\x04 not a zip file at all" * 10)
    torch.save({"model": {}, "config": {}}, root / "foreign.pt")
    shape = dict(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True,
                 tie_weights=True, gelu="tanh")  # the right model_config over the wrong tensors
    torch.save({"model": {"tok_emb.weight": torch.zeros(3)}, "model_config": shape,
                "tokenizer": {"kind": "gpt2", "encoding": "r50k_base"}}, root / "misfit.pt")
    return root


# (overrides on top of the imported GPT-2's matching ones, words the one line must contain)
MISMATCHES = {
    "n_layer": (["model.n_layer=4"], "needs model.n_layer=2 (config: 4)"),
    "n_embd": (["model.n_embd=64"], "model.n_embd=32 (config: 64)"),
    "gelu": (["model.gelu=erf"], "model.gelu=tanh (config: erf)"),
    "qk_norm": (["model.qk_norm=true"], "model.qk_norm=false (config: true)"),  # GPT-2 has none
    "bias": (["model.bias=false"], "model.bias=true (config: false)"),
    "block_size": (["model.block_size=128"], "model.block_size <= 64 (config: 128)"),
    "tokenizer": (["data.tokenizer=char"], "set data.tokenizer=gpt2"),
    "damaged safetensors": (["model.init_from={bad}/truncated"], "not a readable safetensors file"),
    "not gpt2": (["model.init_from={bad}/llama"], "not 'gpt2'"),
    "layer norm eps": (["model.init_from={bad}/eps"], "layer_norm_epsilon=1e-06"),
    "pickle only": (["model.init_from={bad}/bin_only"], "no model.safetensors"),
    "damaged model.pt": (["model.init_from={bad}/garbage.pt"], "not a readable model.pt"),
    "foreign model.pt": (["model.init_from={bad}/foreign.pt"], "not a model.pt of this project"),
    "tensors unlike model_config": (["model.init_from={bad}/misfit.pt"], "do not fit its model_config"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_or_damaged_source_is_refused_in_one_line(case, hf_dir, bad_sources, tmp_path, capsys):
    path, _ = hf_dir
    overrides, words = MISMATCHES[case]
    run = tmp_path / "run"
    capsys.readouterr()
    rc = app.main(TINY + GPT2_RUN + [f"model.init_from={path}", f"trainer.run_dir={run}"]
                  + [o.format(bad=bad_sources) for o in overrides])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (case, rc, err)
    assert words in lines[0], (case, lines[0])
    assert not run.exists(), f"{case}: a refused launch created its run folder"


def test_init_from_adopts_the_source_shape_the_user_did_not_set(hf_dir, tmp_path, capsys):
    """model.init_from takes the source's shape, GELU form and tokenizer from its config.json (or
    model.pt) for every key the user did not set: no restating them. A value the user set that
    conflicts is refused naming both (test_mismatched_or_damaged_source_is_refused_in_one_line)."""
    path, _ = hf_dir
    shapeless = [a for a in TINY if a.split("=")[0] not in ("model.n_layer", "model.n_head", "model.n_embd")]
    base = shapeless + ["parallel.strategy=none", "trainer.max_steps=1", "trainer.sample_tokens=0"]
    run = tmp_path / "from_hf"
    assert app.main(base + [f"model.init_from={path}", f"trainer.run_dir={run}"]) == 0, capsys.readouterr().err
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert {k: recorded["model"][k] for k in ("n_layer", "n_head", "n_embd", "gelu")} == \
        {"n_layer": 2, "n_head": 2, "n_embd": 32, "gelu": "tanh"}
    assert recorded["data"]["tokenizer"] == "gpt2"
    # and from a run's model.pt: its model_config and tokenizer
    again = tmp_path / "from_pt"
    assert app.main(base + [f"model.init_from={run / 'model.pt'}", f"trainer.run_dir={again}"]) == 0
    assert yaml.safe_load((again / "config.yaml").read_text())["model"]["n_head"] == 2


@pytest.mark.launch
def test_named_gpt2_sizes_set_the_shape_for_training_and_plan(tmp_path, capsys):
    """model.size=gpt2-medium is 24 layers x 16 heads x 1024 wide, for --plan and for training;
    a size that does not exist, or a shape key set against the size, is refused in one line."""
    assert app.main(["--plan", "--world-size", "8", "model.size=gpt2-xl", "data.tokenizer=gpt2",
                     "model.block_size=1024", "trainer.batch_size=8", "trainer.micro_batch_size=0",
                     "wandb.enabled=false"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: 48 layers x 1600 wide, 25 heads, block 1024, vocab 50257 (GPT-2 BPE), "
                          "1,557,611,200 parameters"), out[:300]  # GPT-2 XL's 1.5B
    shapeless = [a for a in TINY if a.split("=")[0] not in ("model.n_layer", "model.n_head", "model.n_embd")]
    # a launch resolves the name with the same hook (launch/app.py), before anything is built
    m = load_config(None, shapeless + ["model.size=gpt2-medium"], adopt=adopt_model_shape).model
    assert (m.n_layer, m.n_head, m.n_embd) == (24, 16, 1024)
    run = tmp_path / "refused"
    for bad, words in ((["model.size=gpt3"], "model.size='gpt3' is not one of gpt2, gpt2-medium"),
                       (["model.size=gpt2", "model.n_head=4"], "model.size=gpt2 has model.n_head=12 but "
                                                               "model.n_head=4 is set too")):
        assert app.main(shapeless + bad + [f"trainer.run_dir={run}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not run.exists()


def test_a_hugging_face_folder_is_read_one_tensor_at_a_time_and_only_when_asked(hf_dir, monkeypatch):
    """model.init_from opens the safetensors file and reads no tensor until a rank fills its share
    with it (parallel/materialize.py), then that tensor alone: no rank holds the whole source."""
    import safetensors

    import weights.pretrained as pretrained
    from model import GPT, GPTConfig
    path, _ = hf_dir
    reads = []
    real_open = safetensors.safe_open

    class Counted:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            reads.append(name)
            return self.file.get_tensor(name)

        def get_slice(self, name):
            return CountedSlice(self.file.get_slice(name), name)

    class CountedSlice:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            reads.append(self.name)
            return self.inner[index]

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    source = pretrained.open_source(str(path))
    with torch.device("meta"):
        model = GPT(GPTConfig(**source.model_config))
    weights = pretrained.initial_weights(model, source)
    assert reads == []  # names and shapes checked, nothing read
    q = weights["blocks.0.attn.q_proj.weight"]
    assert reads == ["transformer.h.0.attn.c_attn.weight"] and q.shape == (HF_SHAPE["n_embd"],) * 2
