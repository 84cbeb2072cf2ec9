"""The dry run against the planner on layouts and shapes nobody tuned it on: a seeded random sweep.

    python benchmarks/dry_run_sweep.py --seed 0 --accepted 100       # until 100 cases the launch accepts
    python benchmarks/dry_run_sweep.py --seed 0 --cases 3-7           # those cases of the sequence only
    python benchmarks/dry_run_sweep.py --ci                           # the fixed sample tests/ runs

Case i of seed S is drawn by random.Random(f"{S}:{i}"), so any case can be rerun alone by its
number. A case draws a world of 64 to 1,024 ranks (strategy none: tp x pp x cp, which may be less); a model shape (heads 4-16 of 16-64 dimensions,
block 32-256, the character or the GPT-2 vocabulary); a precision (fp32, bf16 autocast, FSDP2's
bf16 mixed precision); an engine (none, ddp, ZeRO-1/2/3, fsdp, HSDP); tp 1-8 with and without
sequence parallelism and the vocabulary-parallel head; pp 1-8 with each schedule (1f1b, gpipe,
interleaved with 2 stages per rank, zero-bubble and its V) and 1-2 micro-batches per stage;
activation checkpointing; cp 2-4 in both modes (ring, allgather) with strategy none, ddp or
fsdp, composed with tp, pp, bf16 autocast and recomputation (the dry run compares its attention
bytes, kind "cp", and its activations of T/cp tokens with the plan). Depth is 1 or 2 blocks per stage: every figure the dry run compares is per block or per
stage, so depth only repeats them (and the dry run's time grows with it). fp16 is not drawn: the
dry run refuses the grad scaler (exit 2), so its bytes are only planned.

Each case is `python main.py --dry-run` (benchmarks/dry_run_matrix.py's run_case): exit 0, every
figure of every simulated rank within 1% of the plan; 1, a disagreement (the first printed); 2,
a layout the launch refuses (not counted as accepted). The sweep stops after --accepted accepted
cases. Never widen the tolerance to pass a case: a disagreement is a planner bug to fix.
"""
from __future__ import annotations

import argparse
import random
import time

from dry_run_matrix import run_case

SCHEDULES = [["parallel.pp_schedule=1f1b"], ["parallel.pp_schedule=gpipe"],
             ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
             ["parallel.pp_schedule=zero_bubble"], ["parallel.pp_schedule=zero_bubble", "parallel.pp_stages_per_rank=2"]]
ENGINES = {"none": ["parallel.strategy=none"], "ddp": ["parallel.strategy=ddp"],
           "zero-1": ["parallel.strategy=zero", "parallel.zero_stage=1"],
           "zero-2": ["parallel.strategy=zero", "parallel.zero_stage=2"],
           "zero-3": ["parallel.strategy=zero", "parallel.zero_stage=3"],
           "fsdp": ["parallel.strategy=fsdp"], "hsdp": ["parallel.strategy=fsdp", "parallel.dp_replicate=2"]}
# a fixed sample for tests/test_dry_run_sweep.py: cases of seed 0 that the launch accepts, small
# enough for the suite (4-25 s each here): ddp x pp2 in bf16 at 1,024 ranks, ZeRO-2, ZeRO-1 in bf16
# at 512 (its padding), HSDP x tp2 with FSDP2's bf16 and the vocabulary-parallel head, and two cp
# cases the planner was found wrong on: tp4 x pp2 (ZB-V) x cp2 in bf16 with one head per tp rank,
# tp2 x pp8 x cp4 in bf16 with the vocabulary-parallel head and no engine
CI_SAMPLE = (0, [1, 2, 3, 13, 15, 28])


def draw(seed: int, i: int) -> tuple[int, str, list[str]]:
    """(world size, a short name, overrides) of case i of `seed`. The draw keeps to what the
    launch composes (each rule is a refusal of parallel/options.py or planner/alternatives.py):
    ddp and ZeRO-1/2 take no tp (DTensor parameters), ZeRO-1/2 no pp, the zero-bubble schedules
    and strategy none no data parallelism (their world is tp x pp x cp), the zero-bubble schedules no
    recomputation, cp no ZeRO, HSDP or FSDP2 mixed precision."""
    rng = random.Random(f"{seed}:{i}")
    engine = rng.choice(list(ENGINES))
    tp = 1 if engine in ("ddp", "zero-1", "zero-2") else rng.choice([1, 2, 4, 8])
    pp = 1 if engine in ("zero-1", "zero-2") else rng.choice([1, 2, 4, 8])
    cp = rng.choice([2, 4]) if engine in ("none", "ddp", "fsdp") and rng.random() < 0.4 else 1
    schedules = SCHEDULES if engine == "none" else SCHEDULES[:3]  # zero-bubble: dp = 1
    schedule = rng.choice(schedules) if pp > 1 else []
    world = tp * pp * cp if engine == "none" else rng.choice([64, 128, 256, 512, 1024])
    if engine == "hsdp" or (engine != "none" and world < tp * pp * cp * 2):  # 2+ dp ranks (HSDP: 4)
        world = max(world, tp * pp * cp * 4)
    fsdp_mixed = ["fsdp-bf16"] if engine in ("fsdp", "hsdp") else []  # FSDP2's own mixed precision
    precision = rng.choice(["fp32", "bf16", "bf16", *(fsdp_mixed if cp == 1 else [])])
    heads = rng.choice([h for h in (4, 8, 16) if h % tp == 0])  # tp splits the heads
    head_dim = rng.choice([16, 32, 64])
    block = rng.choice([32, 64, 128, 256])
    gpt2 = rng.random() < 0.5
    stages = pp * (2 if "parallel.pp_stages_per_rank=2" in schedule else 1)
    depth = stages * rng.choice([1, 2])
    dp = world // (tp * pp * cp)
    per_stage = rng.choice([1, 2]) if pp > 1 else 1
    micro = rng.choice([1, 2])
    accumulate = 1 if pp > 1 else rng.choice([1, 2])
    microbatches = stages * per_stage if pp > 1 else 0
    batch = dp * micro * max(microbatches, 1) * accumulate
    o = [*ENGINES[engine], f"parallel.tp={tp}", f"parallel.pp={pp}", *schedule,
         f"model.n_layer={depth}", f"model.n_head={heads}", f"model.n_embd={heads * head_dim}",
         f"model.block_size={block}", f"trainer.batch_size={batch}", f"trainer.micro_batch_size={micro}"]
    o += [f"data.tokenizer={'gpt2' if gpt2 else 'char'}"]  # run_case sets gpt2 first
    o += [f"parallel.microbatches={microbatches}"] if pp > 1 else []
    if tp > 1:
        o += [f"parallel.sequence_parallel={rng.choice(['true', 'false'])}",
              f"parallel.tp_vocab_parallel={rng.choice(['true', 'false'])}"]
    if cp > 1:
        o += [f"parallel.cp={cp}", f"parallel.cp_mode={rng.choice(['ring', 'allgather'])}"]
    o += ["trainer.precision=bf16"] if precision == "bf16" else []
    o += ["parallel.mixed_precision=bf16"] if precision == "fsdp-bf16" else []
    recompute = rng.random() < 0.25  # drawn always, so later draws do not move when a rule changes
    o += ["parallel.activation_checkpointing=true"] if recompute and "zero_bubble" not in str(schedule) else []
    name = (f"{engine} tp{tp} pp{pp}{'' if cp == 1 else f' cp{cp}'} {precision} {depth}x{heads * head_dim}"
            f"/{heads}h s{block} {'gpt2' if gpt2 else 'char'}")
    return world, name, o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accepted", type=int, default=100, help="stop after this many accepted cases")
    ap.add_argument("--cases", default="", help="run only case numbers A-B (inclusive)")
    ap.add_argument("--ci", action="store_true", help="the fixed sample tests/test_dry_run_sweep.py runs")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per case")
    args = ap.parse_args()
    seed = CI_SAMPLE[0] if args.ci else args.seed
    if args.ci:
        numbers = iter(CI_SAMPLE[1])
    elif args.cases:
        a, b = (int(x) for x in args.cases.split("-"))
        numbers = iter(range(a, b + 1))
    else:
        numbers = iter(range(10**9))
    print(f"seed {seed} | tolerance 1% (tools/dry_run.py) | case: world, layout, exit, seconds, result", flush=True)
    accepted = agreed = 0
    start = time.monotonic()
    for i in numbers:
        world, name, overrides = draw(seed, i)
        code, seconds, _, first = run_case(world, overrides, args.timeout)
        accepted += code != 2
        agreed += code == 0
        result = {0: "agrees", 2: f"refused: {first}"}.get(code, first)
        print(f"case {i}: world {world} | {name} | exit {code} | {seconds:.0f} s | {result}", flush=True)
        if not args.ci and not args.cases and accepted >= args.accepted:
            break
    print(f"seed {seed}: {accepted} accepted, {agreed} agree, {accepted - agreed} disagree "
          f"({time.monotonic() - start:.0f} s)")
    raise SystemExit(0 if accepted == agreed else 1)


if __name__ == "__main__":
    main()
