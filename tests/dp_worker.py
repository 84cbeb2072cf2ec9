"""Run under torchrun by tests/test_data_parallel.py: many checks of the data-parallel strategies
in ONE launch (imports cost 7-9 s per launch), results written by rank 0 under --out.

  --case NAME "OVERRIDES"    K steps of TINY + overrides (testing.parity.run_steps) -> NAME.pt
  --save NAME "OVERRIDES"    3 steps, then DCP-save strategy.state_dict() -> ckpt-NAME/, and the
                             whole (gathered) state -> ckpt-NAME.expected.pt
  --load CKPT NAME "OVERRIDES"  build a fresh run, load ckpt-CKPT/ (or the absolute path CKPT,
                             written by any strategy and world size) through
                             strategy.state_dict()/load_state_dict() -> NAME.pt
  --buckets                  ShardBucket reduce-scatter/all-gather on odd sizes -> buckets.pt
"""
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from harness import run_worker
from parallel.dtensor import full_tensor
from testing.parity import build, save_cases

SAVE_STEPS = 3
GROUP_KEYS = ("lr", "initial_lr", "weight_decay", "betas", "eps", "params")


def whole(t: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor: the full tensor on every rank, as a plain CPU copy."""
    return full_tensor(t).detach().cpu().clone()


def whole_state(strategy, optimizer) -> dict:
    """Model + optimizer state of any strategy as plain whole tensors keyed by name."""
    sd = strategy.state_dict(optimizer)
    out = {f"model.{k}": whole(v) for k, v in sd["model"].items()}
    for fqn, st in sd["optim"]["state"].items():
        for key, v in st.items():
            out[f"optim.{fqn}.{key}"] = whole(v)
    groups = [{k: g[k] for k in GROUP_KEYS if k in g} for g in sd["optim"]["param_groups"]]
    return {"tensors": out, "param_groups": groups}


def save(name: str, overrides: str, out: Path) -> None:
    trainer = build(["trainer.resume=never", *overrides.split()], out / f"run-save-{name}")
    for _ in range(SAVE_STEPS):
        trainer.train_step()
    state = trainer.strategy.state_dict(trainer.optimizer)
    dcp.save(state, checkpoint_id=str(out / f"ckpt-{name}"))
    expected = whole_state(trainer.strategy, trainer.optimizer)
    if dist.get_rank() == 0:
        torch.save(expected, out / f"ckpt-{name}.expected.pt")


def load(ckpt: str, name: str, overrides: str, out: Path) -> None:
    trainer = build(["trainer.resume=never", *overrides.split()], out / f"run-load-{name}")
    template = trainer.strategy.state_dict(trainer.optimizer)
    path = Path(ckpt) if Path(ckpt).is_absolute() else out / f"ckpt-{ckpt}"  # another launch's
    dcp.load(template, checkpoint_id=str(path))
    trainer.strategy.load_state_dict(template, trainer.optimizer)
    got = whole_state(trainer.strategy, trainer.optimizer)
    if dist.get_rank() == 0:
        torch.save(got, out / f"{name}.pt")


def buckets(out: Path) -> None:
    """Sizes below, at and above the world size, not multiples of it: every rank's slice of the
    mean equals the slice of the true mean, and all_gather rebuilds every tensor exactly."""
    from parallel.zero_shard import ShardBucket, ShardSpec
    n, rank = dist.get_world_size(), dist.get_rank()
    sizes = [1, 2, n - 1, n, n + 1, 3 * n + 2, 37]
    gen = torch.Generator().manual_seed(0)
    per_rank = [[torch.randn(s, generator=gen) for s in sizes] for _ in range(n)]  # same on all ranks
    params = [torch.nn.Parameter(torch.zeros(s)) for s in sizes]
    specs = [ShardSpec.of(s, n, rank) for s in sizes]
    bucket = ShardBucket(params, specs, n, dist.group.WORLD)
    mean_slices = bucket.reduce_scatter(per_rank[rank])
    errors = []
    for i, (spec, got) in enumerate(zip(specs, mean_slices)):
        want = torch.stack([per_rank[r][i] for r in range(n)]).mean(0)[spec.lo:spec.hi]
        errors.append(float((got - want).abs().max()) if want.numel() else 0.0)
        assert got.shape == want.shape, (i, got.shape, want.shape)
    mine = [per_rank[0][i][s.lo:s.hi] for i, s in enumerate(specs)]
    rebuilt = bucket.all_gather(mine)
    exact = all(torch.equal(r, per_rank[0][i]) for i, r in enumerate(rebuilt))
    lengths = [s.length for s in specs]
    gathered = [None] * n
    dist.all_gather_object(gathered, lengths)
    if rank == 0:
        torch.save({"max_error": max(errors), "gather_exact": exact, "lengths": gathered, "sizes": sizes},
                   out / "buckets.pt")


def options(ap) -> None:
    ap.add_argument("--save", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"))
    ap.add_argument("--load", nargs=3, action="append", default=[], metavar=("CKPT", "NAME", "OVERRIDES"))
    ap.add_argument("--buckets", action="store_true")


def body(args) -> None:
    save_cases(args.case, args.steps, args.out)
    for name, overrides in args.save:
        save(name, overrides, args.out)
        dist.barrier()
    for ckpt, name, overrides in args.load:
        load(ckpt, name, overrides, args.out)
        dist.barrier()
    if args.buckets:
        buckets(args.out)


if __name__ == "__main__":
    run_worker(body, options)
