"""Weights out without the whole model: writing model.pt (at the end of a run, and export.py) and
the Hugging Face folder costs the writing process at most about one tensor above what it held
before, whatever the layout that trained the model, and the files read back as before.

The model is 4 x 768 (28M parameters, 114 MB in fp32): a writer that held the whole model once
(the state dict gathered, or a GPT rebuilt from the snapshot) would show 114 MB or more above its
baseline. The bound is one block's fp32 bytes (one FSDP unit, 28 MB: three times the largest
tensor, which covers DCP's read of a tensor, its staging copy and a transposed or fused Hugging Face
tensor). Each process's peak is read around the phase that writes (tests/write_peak_worker.py),
above the same phase of a 4 x 32 model (same code, same imports: what is left is what the tensors
cost)."""
import json
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from model import GPT, GPTConfig
from testing.local import CORPUS, device_overrides, python, torchrun

pytestmark = pytest.mark.launch

SHAPE = dict(n_layer=4, n_head=4, n_embd=768, block_size=64, vocab_size=65)  # the char vocabulary of the corpus
RUN = [f"data.path={CORPUS}", "data.truncate=200000", "model.n_layer=4", "model.n_head=4", "model.block_size=64", "trainer.batch_size=2", "trainer.micro_batch_size=1", "trainer.max_steps=1",
       "trainer.eval_every=0", "trainer.log_every=1", "trainer.save_every=0", "trainer.sample_tokens=0",
       "optimizer.warmup_steps=1", "wandb.enabled=false", *device_overrides()]
with torch.device("meta"):
    _SD = GPT(GPTConfig(**SHAPE)).state_dict()
MODEL_BYTES = sum(t.numel() * 4 for k, t in _SD.items() if k != "lm_head.weight")  # tied: stored once
ALLOWED = sum(t.numel() * 4 for k, t in _SD.items() if k.startswith("blocks.0."))  # one FSDP unit


def model_pt(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def peaks(output: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("WRITE_PEAK ")]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """2-process fsdp runs of the 4 x 768 model and of a 4 x 32 one, their ends (model.pt) measured
    on both ranks: {"big"|"tiny": (run folder, {rank: bytes above})}."""
    runs = {}
    for size, width in (("big", 768), ("tiny", 32)):
        out = tmp_path_factory.mktemp(size)
        run = out / "run"
        r = torchrun(2, ["tests/write_peak_worker.py", "finish", str(out), *RUN, f"model.n_embd={width}",
                         "parallel.strategy=fsdp", f"trainer.run_dir={run}"], timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        found = [json.loads(f.read_text()) for f in sorted(out.glob("write_peak_*.json"))]
        runs[size] = run, {p["rank"]: p["above"] for p in found}
    return runs


def export_peak(run, fmt: str, out) -> int:
    r = python(["tests/write_peak_worker.py", "export", str(run), fmt, str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [p] = peaks(r.stdout)
    return p["above"]


def test_the_model_is_large_enough_to_show_a_whole_model_copy():
    assert MODEL_BYTES > 4 * ALLOWED and MODEL_BYTES > 100e6, (MODEL_BYTES, ALLOWED)


def test_end_of_run_model_pt_costs_each_rank_one_unit_under_fsdp(fsdp_runs):
    (run, big), (_, tiny) = fsdp_runs["big"], fsdp_runs["tiny"]
    assert sorted(big) == sorted(tiny) == [0, 1], (big, tiny)
    for rank in big:
        above = big[rank] - tiny[rank]
        print(f"end of run, rank {rank}: {above / 1e6:.1f} MB above the tiny model's (allowed {ALLOWED / 1e6:.1f})")
        assert above <= ALLOWED, f"rank {rank}: {above / 1e6:.1f} MB above the tiny model's while model.pt was " \
                                 f"written (allowed {ALLOWED / 1e6:.1f}; model {MODEL_BYTES / 1e6:.0f})"
    assert zipfile.ZipFile(run / "model.pt").testzip() is None  # every record's CRC-32 is right
    assert model_pt(run / "model.pt")["model"]["blocks.3.mlp.fc.weight"].shape == (4 * 768, 768)


@pytest.mark.parametrize("fmt", ["pt", "hf"])
def test_export_costs_one_unit_and_writes_the_same_weights(fsdp_runs, tmp_path, fmt):
    (run, _), (tiny_run, _) = fsdp_runs["big"], fsdp_runs["tiny"]
    out = tmp_path / ("model.pt" if fmt == "pt" else "hf")
    above = export_peak(run, fmt, out) - export_peak(tiny_run, fmt, tmp_path / "tiny")
    print(f"export --format {fmt}: {above / 1e6:.1f} MB above the tiny model's (allowed {ALLOWED / 1e6:.1f})")
    assert above <= ALLOWED, f"export --format {fmt}: {above / 1e6:.1f} MB above the tiny model's export " \
                             f"(allowed {ALLOWED / 1e6:.1f}; model {MODEL_BYTES / 1e6:.0f})"
    final = model_pt(run / "model.pt")["model"]
    if fmt == "pt":
        exported = model_pt(out)["model"]
        assert exported.keys() == final.keys()
        assert all(torch.equal(exported[k], final[k]) for k in final)
    else:
        hf = load_file(out / "model.safetensors")
        c = 768
        assert torch.equal(hf["transformer.h.1.mlp.c_fc.weight"], final["blocks.1.mlp.fc.weight"].t())
        assert torch.equal(hf["transformer.h.2.attn.c_attn.weight"][:, c:2 * c], final["blocks.2.attn.k_proj.weight"].t())
