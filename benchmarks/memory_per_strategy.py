"""Per-rank resident bytes of parameters, gradients and AdamW state for each data-parallel
strategy, measured from the local tensors (Strategy.resident_bytes) after the backward of the
second step, next to the seed formulas for fp32 Adam (a parameters, n ranks).

    python benchmarks/memory_per_strategy.py                 # n = 2, the default GPT config
    python benchmarks/memory_per_strategy.py --nproc 4 data.tokenizer=gpt2   # 50257-token vocab

It relaunches itself under torchrun (CPU, gloo) while holding the machine-wide multi-process lock
that the tests use. Extra arguments are config overrides (the default config is
gpt2_train_cfg.yaml with the local Tiny Shakespeare copy). The last row measures torch's own
ZeroRedundancyOptimizer (DDP + whole-tensor partitioning), which the zero strategy does not use.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)

from testing.local import CORPUS, benchmark_main

# name -> (overrides, what is sharded, formula as text, formula(a, n) in bytes)
STRATEGIES = {
    "ddp": ("parallel.strategy=ddp", "nothing", "4a + 4a + 8a", lambda a, n: 16 * a),
    "zero-1": ("parallel.strategy=zero parallel.zero_stage=1", "optimizer state", "4a + 4a + 8a/n",
               lambda a, n: 8 * a + 8 * a / n),
    "zero-2": ("parallel.strategy=zero parallel.zero_stage=2", "+ gradients", "4a + 12a/n",
               lambda a, n: 4 * a + 12 * a / n),
    "zero-3": ("parallel.strategy=zero parallel.zero_stage=3", "+ parameters", "16a/n", lambda a, n: 16 * a / n),
    "fsdp": ("parallel.strategy=fsdp", "parameters, gradients, optimizer state", "16a/n",
             lambda a, n: 16 * a / n),
}


def worker(overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from checks import load_config
    from config import DEFAULT_CONFIG
    from launch.build import build_trainer
    from parallel.env import init_distributed

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="mem-bench-"))
    for name, (strategy, sharded, formula, fn) in STRATEGIES.items():
        cfg = load_config(str(DEFAULT_CONFIG), [f"data.path={CORPUS}", "wandb.enabled=false",
                                                f"trainer.run_dir={tmp / name}", *strategy.split(), *overrides])
        env = init_distributed(cfg)
        trainer = build_trainer(cfg, env, tmp / name)
        for step in range(2):
            trainer.forward_backward()
            if step == 1:
                mine = trainer.strategy.resident_bytes(trainer.optimizer)
            trainer.optimizer_step()
        every = [None] * env.world_size
        dist.all_gather_object(every, mine)
        rows.append((name, sharded, formula, fn, every, trainer.model_cost.num_params, trainer.strategy.dp_size))
    rows.append(zero_redundancy_row(cfg, env, trainer.model_config["vocab_size"]))
    if env.rank == 0:
        a, n = rows[0][5], rows[0][6]
        m = cfg.model
        print(f"\nconfig: GPT n_layer={m.n_layer} n_head={m.n_head} n_embd={m.n_embd} block_size={m.block_size}, "
              f"a = {a:,} parameters, fp32 AdamW, n = {n} ranks (CPU, gloo), torch {torch.__version__}")
        print("bytes per rank after the backward of step 2 (params + grads + Adam state); the split is the "
              "fullest rank's\n")
        print("| strategy | shards | formula | formula bytes | measured, fullest rank | params / grads / Adam state "
              "| fullest / formula | emptiest / formula |")
        print("|---|---|---|---|---|---|---|---|")
        for name, sharded, formula, fn, every, _, _ in rows:
            totals = [sum(d.values()) for d in every]
            top = every[totals.index(max(totals))]
            want = fn(a, n)
            split = " / ".join(f"{top[k]:,}" for k in ("params", "grads", "optimizer"))
            print(f"| {name} | {sharded} | {formula} | {want:,.0f} | {max(totals):,} | {split} | "
                  f"{max(totals) / want:.4f} | {min(totals) / want:.4f} |")
    dist.barrier()
    dist.destroy_process_group()


def zero_redundancy_row(cfg, env, vocab_size: int):
    """torch's ZeroRedundancyOptimizer over DDP: each rank gets WHOLE parameter tensors (greedy by
    size), so its share of the 8a of Adam state depends on how the tensor sizes pack."""

    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from model import GPT, GPTConfig, lm_loss
    from parallel.strategy import resident_bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig.of(cfg.model, vocab_size))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, vocab_size, (2, cfg.model.block_size))
    for _ in range(2):
        lm_loss(ddp(x), x).backward()
        opt.step()
    mine = resident_bytes([model], opt.optim)  # the local optimizer holds this rank's partition
    every = [None] * env.world_size
    dist.all_gather_object(every, mine)
    return ("ZeroRedundancyOptimizer (torch, not used)", "optimizer state, whole tensors", "4a + 4a + 8a/n",
            lambda a, n: 8 * a + 8 * a / n, every, None, None)


def main() -> None:
    benchmark_main(__doc__, __file__, worker, timeout_s=300)


if __name__ == "__main__":
    main()
