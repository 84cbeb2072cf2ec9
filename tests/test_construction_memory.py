"""The memory each layout promises is the memory it uses from the first byte: every worker's peak
resident set above the same launch of a tiny model, as a fraction of the whole model's fp32 bytes,
when the model is built and through the first optimizer step (AdamW's state included). Read from
outside while each worker is stopped at those two moments (testing/memory_probe.py, the same
readings benchmarks/construction_memory.py prints for the 16 x 1024 model).

The model here is 16 x 512 (50M parameters, 201 MB in fp32): the same 16 blocks as the benchmark's
(a block is what FSDP gathers at a time, so the ratio through a step depends on the block count,
not the width), a quarter of its bytes, so that 8 processes start on two cores in reasonable time.
Bounds: fsdp and zero-3 on 8 processes at most 0.3x built and below 0.8x through the first step
(an eighth of parameters, gradients and AdamW's two moments is 0.5x; one or two gathered blocks on
top); tp=2 and pp=2 at most 0.6x built (half the model each)."""
import pytest

from testing.local import CORPUS, REPO
from testing.memory_probe import measure

pytestmark = pytest.mark.launch

N_LAYER, N_EMBD = 16, 512
MODEL = [f"model.n_layer={N_LAYER}", "model.n_head=8", f"model.n_embd={N_EMBD}"]
TINY = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64"]  # 2 blocks: pp=2 needs one per stage
# fp32 bytes: per block 12 C^2 weights + 13 C biases and norms; embeddings (char vocab 65, 64
# positions; the head is tied) and the final norm
MODEL_BYTES = 4 * (N_LAYER * (12 * N_EMBD ** 2 + 13 * N_EMBD) + (65 + 64) * N_EMBD + 2 * N_EMBD)
COMMON = [f"data.path={CORPUS}", "data.truncate=200000", "model.block_size=64", "trainer.batch_size=8",
          "trainer.micro_batch_size=1", "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
          "trainer.save_every=0", "trainer.sample_tokens=0", "wandb.enabled=false", "trainer.hang_timeout_s=0",
          "optimizer.warmup_steps=1"]


def ratios(nproc: int, layout: list[str]) -> dict[str, dict[int, float]]:
    """{"built"|"step": {rank: peak above the tiny launch's same rank / the model's fp32 bytes}}."""
    big = measure(REPO, nproc, COMMON + MODEL + layout, timeout=300)
    tiny = measure(REPO, nproc, COMMON + TINY + layout, timeout=300)
    found = {k: {r: (big[k][r] - tiny[k][r]) / MODEL_BYTES for r in big[k]} for k in big}
    print({k: {r: round(v, 3) for r, v in sorted(per.items())} for k, per in found.items()})
    return found


@pytest.mark.parametrize("layout", [["parallel.strategy=fsdp"], ["parallel.strategy=zero", "parallel.zero_stage=3"]],
                         ids=["fsdp", "zero-3"])
def test_a_sharded_layout_holds_its_share_on_every_worker_from_the_first_byte(layout):
    found = ratios(8, layout)
    assert sorted(found["built"]) == list(range(8)), found
    for rank in range(8):
        assert found["built"][rank] <= 0.3, (rank, found)
        assert found["step"][rank] < 0.8, (rank, found)


@pytest.mark.parametrize("layout", [["parallel.strategy=none", "parallel.tp=2"], ["parallel.strategy=none", "parallel.pp=2"]],
                         ids=["tp=2", "pp=2"])
def test_tensor_and_pipeline_parallel_build_half_the_model_per_worker(layout):
    found = ratios(2, layout)
    assert sorted(found["built"]) == [0, 1], found
    for rank in (0, 1):
        assert found["built"][rank] <= 0.6, (rank, found)
