"""Bytes on the wire per optimizer step for each data-parallel strategy, measured on the loopback
interface, next to the ring volumes of theory.

Theory for fp32 gradients and parameters (K = 4a bytes for a parameters, n ranks), totals over
all ranks per step:

    ddp, zero-1, zero-2       2(n-1)K   a reduce-scatter + an all-gather (= a ring all-reduce)
    zero-3, fsdp              3(n-1)K   + the all-gather again in backward (parameters resharded)
    fsdp, no reshard          2(n-1)K   backward reuses forward's all-gather

    python benchmarks/bytes_per_strategy.py               # n = 2, the default GPT config
    python benchmarks/bytes_per_strategy.py --nproc 4

It relaunches itself under torchrun (CPU, gloo, all ranks on this machine, so every byte crosses
`lo`) while holding the machine-wide multi-process lock the tests use, so no other job's traffic
shares the interface; anything else on `lo` would be counted too. Each strategy trains 2 warm-up
steps, then STEPS steps between two reads of /proc/net/dev (bytes the interface transmitted; TCP/IP
headers included, about 0.1% at loopback's 64 KiB packets), with one micro-batch per step (ZeRO-2
reduces every micro-batch by design) and no eval or snapshot in between. What the training loop
adds besides the strategy's own traffic (the loss and memory all-reduces of log steps, the stop
vote) is a few hundred bytes per step. Extra arguments are config overrides.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)

from testing.local import CORPUS, benchmark_main
from tools.measure import loopback_tx_bytes

STEPS = 5

# name -> (overrides, theory as text, theory(K, n): total bytes over the ranks per step)
STRATEGIES = {
    "ddp": ("parallel.strategy=ddp", "2(n-1)K", lambda k, n: 2 * (n - 1) * k),
    "zero-1": ("parallel.strategy=zero parallel.zero_stage=1", "2(n-1)K", lambda k, n: 2 * (n - 1) * k),
    "zero-2": ("parallel.strategy=zero parallel.zero_stage=2", "2(n-1)K", lambda k, n: 2 * (n - 1) * k),
    "zero-3": ("parallel.strategy=zero parallel.zero_stage=3", "3(n-1)K", lambda k, n: 3 * (n - 1) * k),
    "fsdp": ("parallel.strategy=fsdp", "3(n-1)K", lambda k, n: 3 * (n - 1) * k),
    "fsdp, no reshard": ("parallel.strategy=fsdp parallel.reshard_after_forward=false", "2(n-1)K",
                         lambda k, n: 2 * (n - 1) * k),
}


def worker(overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from checks import load_config
    from config import DEFAULT_CONFIG
    from launch.build import build_trainer
    from parallel.env import init_distributed

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bytes-bench-"))
    for name, (strategy, formula, fn) in STRATEGIES.items():
        cfg = load_config(str(DEFAULT_CONFIG), [
            f"data.path={CORPUS}", "wandb.enabled=false", f"trainer.run_dir={tmp / name}",
            "trainer.micro_batch_size=0", *strategy.split(), *overrides])
        env = init_distributed(cfg)
        trainer = build_trainer(cfg, env, tmp / name)
        for _ in range(2):
            trainer.train_step()
        dist.barrier()
        before = loopback_tx_bytes()
        for _ in range(STEPS):
            trainer.train_step()
        dist.barrier()
        moved = (loopback_tx_bytes() - before) / STEPS
        rows.append((name, formula, fn, moved, trainer.model_cost.num_params, env.world_size))
    if env.rank == 0:
        a, n = rows[0][4], rows[0][5]
        m = cfg.model
        print(f"\nconfig: GPT n_layer={m.n_layer} n_head={m.n_head} n_embd={m.n_embd}, a = {a:,} parameters, "
              f"K = 4a = {4 * a:,} bytes, n = {n} ranks (CPU, gloo), torch {torch.__version__}")
        print(f"bytes transmitted on lo per optimizer step (mean of {STEPS} steps), all ranks together\n")
        print("| strategy | theory | theory bytes | measured bytes | measured / theory |")
        print("|---|---|---|---|---|")
        for name, formula, fn, moved, _, _ in rows:
            want = fn(4 * a, n)
            print(f"| {name} | {formula} | {want:,.0f} | {moved:,.0f} | {moved / want:.3f} |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    loopback_tx_bytes()  # fail early without /proc/net/dev
    benchmark_main(__doc__, __file__, worker, timeout_s=600)


if __name__ == "__main__":
    main()
