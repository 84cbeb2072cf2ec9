"""The full 3-D mesh: dp=2 x tp=2 x pp=2 on 8 processes (CPU, gloo) against one process, and
in the same launch HSDP x tp (2 replicas x 2 shards x tp 2) and context parallelism inside 3-D
meshes (cp 2 x tp 2 x pp 2; dp 2 x cp 2 x tp 2).

Trains the tests' TINY model for 6 steps with FSDP2 over dp, Megatron TP over tp and a 1F1B
pipeline over pp (tied embedding/head: first and last stage sum its gradient), in ONE 8-process
launch (this script, relaunched under torchrun), and checks parity with a single process exactly
as tests/test_tp_pp.py does (testing/parity.py): first-step gradients <= 1e-6 abs, loss <= 1e-4 and
gradient norm <= 1e-5 relative at each step, parameters after the first and the last step <= 1e-5
abs, validation loss after the last step.
Optionally also the whole app (main.py) in the same launch: on the mesh, and with the default
config as `torchrun --nproc_per_node=8 main.py` runs it (ddp over 8, 3 steps; main.main in the
launch's process group). The tests run it with --app --keep DIR in CI (about 75 s on 2 cores,
about 30 s of it the start-up of 8 processes) and read both run folders under DIR:

    python benchmarks/mesh_2x2x2.py            # parity case, prints the per-step losses
    python benchmarks/mesh_2x2x2.py --app      # + main.py on the mesh and with the default config
    python benchmarks/mesh_2x2x2.py --app --keep DIR  # keep the run folders and the launch's output
Exit status 0 = parity holds (and both app runs succeeded).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)

from testing.local import CORPUS, TINY, torchrun
from testing.parity import assert_parity, load_case, parity_errors, run_steps, save_cases

STEPS = 6
MESH = "parallel.strategy=fsdp parallel.tp=2 parallel.pp=2 parallel.pp_schedule=1f1b"
# HSDP composed with tensor parallelism on the same 8 processes: dp_replicate 2 x dp_shard 2 x tp 2
HSDP_TP = "parallel.strategy=fsdp parallel.dp_replicate=2 parallel.tp=2"
# context parallelism inside 3-D meshes on the same 8 processes: cp 2 x tp 2 x pp 2 (ring), and
# dp 2 x cp 2 x tp 2 (allgather; FSDP2 over dp x cp)
CP_MESHES = {"cp_tp_pp": "parallel.strategy=fsdp parallel.cp=2 parallel.tp=2 parallel.pp=2",
             "dp_cp_tp": "parallel.strategy=fsdp parallel.cp=2 parallel.tp=2 parallel.cp_mode=allgather"}
# gpt2_train_cfg.yaml untouched but for the corpus, the run folder and a short run (3 steps, 2 eval batches)
DEFAULT_STEPS = 3
DEFAULT_APP = [f"data.path={CORPUS}", f"trainer.max_steps={DEFAULT_STEPS}", "trainer.eval_batches=2"]


def worker(out: Path, with_app: bool) -> None:
    """One rank of the 8-process launch: both parity cases (testing.parity.run_steps; rank 0 saves
    OUT/NAME.pt) and, with `with_app`, main.py on the mesh (OUT/app) and with the default config
    (OUT/default), all in one process group; rank 0 writes each run's worst exit code over the
    8 ranks to OUT/app_exit_codes.json."""
    import torch.distributed as dist

    import main

    save_cases([("mesh", MESH), ("hsdp_tp", HSDP_TP), *CP_MESHES.items()], STEPS, out, evaluate=True)
    if with_app:
        codes = [main.main(TINY + MESH.split() + [f"trainer.max_steps={STEPS}", f"trainer.run_dir={out / 'app'}"],
                           keep_process_group=True)]
        dist.barrier()
        codes.append(main.main(DEFAULT_APP + [f"trainer.run_dir={out / 'default'}"], keep_process_group=True))
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, codes)  # a failure on any rank counts, as torchrun's exit would
        if dist.get_rank() == 0:
            (out / "app_exit_codes.json").write_text(json.dumps([max(c[i] for c in every_rank) for i in range(2)]))
    dist.barrier()
    dist.destroy_process_group()


def measure(out: Path, app: bool) -> int:
    """The reference in this process, then the 8-process launch; prints the figures, checks parity
    (and the app runs), 0 when everything holds. Outputs under `out`."""
    ref = run_steps(["parallel.strategy=none"], STEPS, out / "ref", evaluate=True)
    cmd = [str(Path(__file__).resolve()), "--worker", "--out", str(out), *(["--app"] if app else [])]
    t0 = time.perf_counter()
    r = torchrun(8, cmd, timeout=300)
    wall = time.perf_counter() - t0
    (out / "launch.out").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-3000:], sep="\n")
        return 1
    got = load_case(out, "mesh")
    print(f"8-process launch: {wall:.0f} s wall (dp=2 x tp=2 x pp=2, {STEPS} steps + eval)")
    print("step  loss: one process   2x2x2 mesh   grad norm: one process   2x2x2 mesh")
    for i, (a, b, na, nb) in enumerate(zip(ref["losses"], got["losses"], ref["grad_norms"],
                                           got["grad_norms"])):
        print(f"{i:4d}  {a:.7f}   {b:.7f}   {na:.7f}   {nb:.7f}")
    print(f"val   {ref['val_loss']:.7f}   {got['val_loss']:.7f}")
    errors = parity_errors(ref, got)
    print(f"max differences: first-step gradients {errors['grad_abs']:.1e} abs over "
          f"{len(ref['grads'])} tensors, gradient norm {errors['norm_rel']:.1e} rel, parameters "
          f"after the first step {errors['first_param_abs']:.1e} abs, after the last "
          f"{errors['param_abs']:.1e} abs")
    assert_parity(ref, got, "dp2 x tp2 x pp2")
    assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-4 * ref["val_loss"]
    hsdp = load_case(out, "hsdp_tp")
    errors = parity_errors(ref, hsdp)
    print(f"hsdp 2x2 x tp 2: max differences: gradient norm {errors['norm_rel']:.1e} rel, parameters "
          f"after the last step {errors['param_abs']:.1e} abs")
    assert_parity(ref, hsdp, "dp_replicate2 x dp_shard2 x tp2")
    for name in CP_MESHES:
        errors = parity_errors(ref, load_case(out, name))
        print(f"{name}: max differences: gradient norm {errors['norm_rel']:.1e} rel, parameters "
              f"after the last step {errors['param_abs']:.1e} abs")
        assert_parity(ref, load_case(out, name), name)
    print("parity: OK")
    if app:
        codes = json.loads((out / "app_exit_codes.json").read_text())
        for (where, folder), code in zip((("on the mesh", "app"), ("with the default config", "default")), codes):
            files = sorted(p.name for p in (out / folder).iterdir())
            print(f"main.py {where}: exit {code}, wrote {', '.join(files)}")
            if code != 0 or "model.pt" not in files:
                return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--app", action="store_true",
                    help="also run main.py on the 2x2x2 mesh and with the default config")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="write the outputs (run folders, the launch's output in launch.out) to DIR, kept")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.app)
        return 0
    if args.keep:
        if args.keep.exists() and any(args.keep.iterdir()):  # its run folders would resume, not train
            ap.exit(2, f"error: --keep {args.keep} is not empty: name a new or empty folder\n")
        args.keep.mkdir(parents=True, exist_ok=True)
        return measure(args.keep, args.app)
    with tempfile.TemporaryDirectory() as tmp:
        return measure(Path(tmp), args.app)


if __name__ == "__main__":
    sys.exit(main())
