"""The planner's predicted throughput beside a published table of measured throughput.

    python benchmarks/published_throughput.py

The table: MosaicML's MPT training benchmarks (llm-foundry, scripts/train/benchmarking/README.md,
https://github.com/mosaicml/llm-foundry/tree/main/scripts/train/benchmarking), measured with
FSDP FULL_SHARD (this project's `parallel.strategy=fsdp`), bf16 autocast, sequence 2048, on DGX
nodes of 8 A100-80GB (1600 Gb/s RoCE between nodes) and of 8 H100-80GB. The rows here are those
without activation checkpointing. MPT blocks are GPT-2 blocks with biases and 4x MLPs (the
published parameter counts match 12 h^2 + 13 h per block, a learned position embedding and a tied
embedding of 50,368 tokens; here GPT-2's 50,257: 0.1-0.3% of the parameters). What differs:
MPT runs FlashAttention and fused Triton kernels, this project's GPU path runs PyTorch SDPA.

The second table: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (https://arxiv.org/abs/2104.04473), Table 1: GPT models of 1.7B-1T
parameters with tensor and pipeline parallelism on up to 3,072 A100-80GB (DGX A100 nodes of 8,
8 x 200 Gb/s HDR InfiniBand), fp16, sequence 2048, vocabulary 51,200, activation recomputation.
It gives the achieved teraFLOP/s per GPU counted with the paper's own formula (its Eq. 3, which
counts the recomputed forward: 96 B s l h^2 (1 + s/6h + V/16lh) per step), so the step time it
implies is that count / (teraFLOP/s x GPUs). Megatron's data parallelism is a plain gradient
all-reduce; this project cannot put DDP over tensor-parallel (DTensor) parameters, and runs the
same layout as HSDP with shard groups of one (`parallel.dp_replicate` = dp: FSDP2 then only
all-reduces gradients across the replicas, DDP's traffic). The table gives neither the micro-batch
size nor the schedule: rows are predicted with 1F1B at micro-batch 1 and 2.

Each row goes through the same `planner.plan_layout` and `--hardware` description that
`python main.py --plan` ranks layouts by; the script prints predicted and published tokens/s per
GPU (and, for the second table, teraFLOP/s per GPU in the paper's count), their ratio, and the
largest terms of the prediction. Nothing runs on a GPU.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import _repo  # noqa: F401  (the repository on sys.path)

import planner
from checks import load_config

SOURCE = "https://github.com/mosaicml/llm-foundry/tree/main/scripts/train/benchmarking"
MPT = {  # name -> (layers, width, heads) of llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml
    "125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
    "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
}


@dataclass(frozen=True)
class Row:
    hardware: str  # planner/hardware/NAME.yaml
    model: str  # MPT key
    gpus: int
    micro_batch: int  # sequences per GPU per forward/backward
    grad_accum: int
    global_batch: int  # sequences per optimizer step
    tokens_per_gpu: float  # published Throughput (T/s/GPU)
    mfu: float  # published MFU, percent


# seq 2048, FULL_SHARD, amp_bf16, no activation checkpointing, copied from the two tables
ROWS = [
    Row("a100-80gb", "125m", 8, 40, 2, 640, 142830, 44.79),
    Row("a100-80gb", "350m", 8, 32, 2, 512, 58782, 51.62),
    Row("a100-80gb", "760m", 8, 24, 2, 384, 32434, 56.85),
    Row("a100-80gb", "1b", 8, 14, 4, 448, 20513, 59.86),
    Row("a100-80gb", "3b", 8, 10, 2, 160, 10811, 62.11),
    Row("a100-80gb", "7b", 8, 6, 2, 96, 4641, 64.23),
    Row("a100-80gb", "13b", 8, 2, 3, 48, 2262, 59.57),
    Row("h100-sxm", "760m", 8, 24, 2, 384, 63147, 34.90),
    Row("h100-sxm", "760m", 32, 24, 1, 768, 67971, 37.57),
    Row("h100-sxm", "1b", 8, 14, 1, 112, 45455, 41.82),
    Row("h100-sxm", "1b", 64, 20, 1, 1280, 44402, 40.85),
    Row("h100-sxm", "3b", 16, 10, 3, 480, 24142, 43.73),
    Row("h100-sxm", "3b", 64, 6, 3, 1152, 22525, 40.80),
    Row("h100-sxm", "7b", 8, 6, 1, 48, 10643, 46.44),
    Row("h100-sxm", "13b", 8, 2, 1, 16, 4792, 39.79),
    Row("h100-sxm", "13b", 64, 2, 1, 128, 4800, 39.86),
]


def predict(row: Row):
    layers, width, heads = MPT[row.model]
    cfg = load_config(None, [
        "data.tokenizer=gpt2", f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}",
        "model.block_size=2048", "model.dropout=0.0", "model.bias=true", f"trainer.batch_size={row.global_batch}",
        f"trainer.micro_batch_size={row.micro_batch}", "trainer.precision=bf16", "parallel.strategy=fsdp",
        "parallel.mixed_precision=bf16"])
    g = planner.gpt_config(cfg, planner.vocab_size(cfg)[0])
    hw = planner.load_hardware(row.hardware, "bf16")
    lay = planner.check_layout(cfg, row.gpus)
    return planner.plan_layout(cfg, g, lay, True, None, hw).time


MEGATRON_SOURCE = "Table 1 of https://arxiv.org/abs/2104.04473"
MEGATRON_VOCAB = 51200


@dataclass(frozen=True)
class MegatronRow:
    billions: float  # published parameter count
    heads: int
    width: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int  # sequences per optimizer step
    tflops: float  # published achieved teraFLOP/s per GPU (Eq. 3's count)

    def step_flops(self, seq: int = 2048) -> float:
        """The paper's Eq. 3: FLOPs of one step with activation recomputation."""
        h, l, v = self.width, self.layers, MEGATRON_VOCAB
        return 96 * self.batch * seq * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))


MEGATRON_ROWS = [  # Table 1, copied row by row; GPUs = tp x pp x dp
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def predict_megatron(row: MegatronRow, micro_batch: int):
    """This project's nearest layout: tp and pp as published, vocabulary-parallel head (Megatron's),
    1F1B, recomputation; dp as DDP (tp = 1) or HSDP with shard groups of one (tp > 1)."""
    dp = row.gpus // (row.tp * row.pp)
    data_parallel = (["parallel.strategy=ddp"] if row.tp == 1 else
                     ["parallel.strategy=fsdp", f"parallel.dp_replicate={dp}", "parallel.mixed_precision=fp16"])
    cfg = load_config(None, [
        "data.tokenizer=gpt2", f"model.n_layer={row.layers}", f"model.n_embd={row.width}",
        f"model.n_head={row.heads}", "model.block_size=2048", "model.dropout=0.0", "model.bias=true",
        f"trainer.batch_size={row.batch}", f"trainer.micro_batch_size={micro_batch}", "trainer.precision=fp16",
        *data_parallel, f"parallel.tp={row.tp}", f"parallel.pp={row.pp}", "parallel.pp_schedule=1f1b",
        f"parallel.tp_vocab_parallel={str(row.tp > 1).lower()}", "parallel.activation_checkpointing=true"])
    g = planner.gpt_config(cfg, MEGATRON_VOCAB)
    hw = planner.load_hardware("a100-80gb", "fp16")
    return planner.plan_layout(cfg, g, planner.check_layout(cfg, row.gpus), True, None, hw).time


def largest_terms(t) -> str:
    return ", ".join(f"{x.name} {x.exposed:.3g} s" for x in sorted(t.terms, key=lambda x: -x.exposed)[:3])


def print_megatron() -> None:
    print(f"\npublished: Narayanan et al. 2021, Megatron-LM on A100-80GB ({MEGATRON_SOURCE}); "
          "teraFLOP/s per GPU in the paper's count (Eq. 3, recomputation included)")
    print(f"{'params':>7s} {'tp':>2s} {'pp':>3s} {'dp':>3s} {'GPUs':>5s} {'published':>9s} "
          f"{'pred mb 1':>9s} {'ratio':>5s} {'pred mb 2':>9s} {'ratio':>5s}  largest terms (mb 1)")
    ratios = []
    for row in MEGATRON_ROWS:
        cells, first = [], None
        for micro_batch in (1, 2):
            t = predict_megatron(row, micro_batch)
            tflops = row.step_flops() / (t.step_s * row.gpus) / 1e12
            ratios.append(tflops / row.tflops)
            cells.append(f"{tflops:9.0f} {tflops / row.tflops:5.2f}")
            first = first or t
        dp = row.gpus // (row.tp * row.pp)
        print(f"{row.billions:6.1f}B {row.tp:2d} {row.pp:3d} {dp:3d} {row.gpus:5d} {row.tflops:9.0f} "
              f"{' '.join(cells)}  {largest_terms(first)}")
    print(f"megatron: predicted / published teraFLOP/s per GPU: median {statistics.median(ratios):.2f}, "
          f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} predictions")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(f"published: MosaicML llm-foundry MPT benchmarks ({SOURCE}); predicted: planner/timing.py")
    print(f"{'hardware':10s} {'model':5s} {'GPUs':>4s} {'mb x accum':>10s} {'tok/s/GPU pred':>15s} "
          f"{'published':>10s} {'ratio':>6s} {'MFU pred':>9s} {'published':>9s}  largest terms")
    ratios: dict[str, list[float]] = {}
    for row in ROWS:
        t = predict(row)
        per_gpu = t.tokens_per_s / row.gpus
        ratio = per_gpu / row.tokens_per_gpu
        ratios.setdefault(row.hardware, []).append(ratio)
        terms = ", ".join(f"{x.name} {1000 * x.exposed:.0f} ms"
                          for x in sorted(t.terms, key=lambda x: -x.exposed)[:2])
        print(f"{row.hardware:10s} {row.model:5s} {row.gpus:4d} {f'{row.micro_batch} x {row.grad_accum}':>10s} "
              f"{per_gpu:15,.0f} {row.tokens_per_gpu:10,.0f} {ratio:6.2f} {100 * t.mfu:8.1f}% {row.mfu:8.1f}%  {terms}")
    for hw, rs in ratios.items():
        print(f"{hw}: predicted / published tokens/s per GPU: median {statistics.median(rs):.2f}, "
              f"range {min(rs):.2f}-{max(rs):.2f} over {len(rs)} rows")
    print_megatron()


if __name__ == "__main__":
    main()
