"""The `--plan` table as text: one row per layout (the configured one marked *; two engines that
give the same layout on one row, 'zero-3=fsdp'), refusals grouped by reason when nothing runs,
what makes a layout fit when none does, and the legend of formulas under it, or with --explain
every formula, every refusal and each term of the first row's step time. The measurements that
check the formulas are in docs/planner.md and docs/layouts.md, not here: they would go stale."""
from __future__ import annotations

import os
import re
import sys
import textwrap

from planner.compute import causal_pairs
from planner.records import LayoutPlan, Plan
from planner.units import fmt_bytes

LEGEND = """\
per rank, the fullest rank (GB = 10^9 bytes); a = parameters held, n = dp ranks, K = bytes of a collective's payload
  params/grads/Adam: fp32 AdamW, ZeRO (Rajbhandari et al. 2020): ddp 4a+4a+8a = 16a | zero-1 4a+4a+8a/n | zero-2 4a+12a/n | zero-3, fsdp 16a/n
  hsdp RxS (fsdp, parallel.dp_replicate=R): 16a/S per rank; all-gather and reduce-scatter within a group of S, all-reduce of the shards over R
  act: saved for backward x micro-batches in flight (gpipe: M, 1f1b: min(M, p - rank), interleaved/zero-bubble: torch's order);
       per block fp32 16bsh x 4 B + 16bs + 4b(heads)s (Korthikanti et al. 2022's 34sbh + 5as^2b, adapted to SDPA: --explain)
  moved: ring volume per rank per step: all-reduce 2K(n-1)/n, reduce-scatter and all-gather K(n-1)/n each: ddp and zero-1/2 2K(n-1)/n;
       zero-3/fsdp all-gather every unit twice (forward, backward) + reduce-scatter = 3K(n-1)/n (no-reshard: gathered once, 2K(n-1)/n)
  step: slowest rank's 3 x forward FLOPs (+1 forward with checkpointing) / (efficiency x peak) + bubble + communication
       not hidden (latency per ring step + bytes / link bandwidth, FSDP2's x fsdp_byte_time where measured; DDP buckets and
       FSDP2 overlap compute, tp and pp do not)
       + AdamW's 32 B per element / memory bandwidth; MFU = (6N + 12Lhs) x tokens/s / (peak x ranks): docs/planner.md#step-time
  measured against these: docs/planner.md (every layout, benchmarks/strategy_report.py), docs/layouts.md#bytes-on-the-wire"""

EXPLAIN = """\
formulas (b = micro-batch sequences, s = block_size, h = n_embd, V = vocabulary, t = tp, E = bsh elements):
  parameters per rank: model.py's shapes; tp splits q/k/v/fc rows and out_proj/proj columns (ceil(dim/t)); zero-1/2 keep
    ceil(numel/n) elements of each tensor; zero-3/fsdp ceil(dim0/n) rows (FSDP2 pads the dim-0 chunks); pp: each stage its
    blocks, the first the embeddings, the last ln_f and a copy of the tied embedding/head (both copies are in the optimizer)
  gradients: as parameters (zero-2 and fsdp: sharded; ddp buckets are the gradients with gradient_as_bucket_view)
  activations per block, saved for backward (measured op by op with saved_tensors_hooks on this model):
    ln_1 and ln_2 inputs 2E (fp32) + mean/rstd 4bs fp32; q/k/v input E and fc input E (autocast: 3 + 1 16-bit copies);
    q, k, v 3E/t; SDPA output E/t (the out_proj input) + logsumexp b(heads/t)s fp32; GELU input and output 8E/t;
    dropout > 0: 2 masks E (bool on CUDA, the activation dtype on CPU, where SDPA also falls back to its math kernel
    and saves 3 b(heads/t)s^2 attention matrices); autocast: a 16-bit copy of every weight (12h^2/t).
    fp32 total 64sbh + 16sb + 4as bytes; Korthikanti et al. 2022 eq. 1 counts 34sbh + 5as^2b in 16-bit without
    fused attention. Sequence parallel splits LayerNorm inputs/stats and masks over t; the gathered q/k/v and fc
    inputs stay whole. Activation checkpointing keeps the block input only (E fp32) and recomputes one block in
    backward (counted as transient). First stage: token and position ids (int64); last stage: ln_f input E, head
    input E, log-softmax output 4bsV (fp32; /t with vocab-parallel loss), targets.
  transient: logits + their fp32 gradient at the loss (bsV (e + 4)), or one recomputed block with checkpointing
  buffers: zero-1/2: the largest bucket (bucket_cap_mb) (zero-2: twice) + its slice; fsdp/zero-3: root parameters
    gathered (at the peak: the loss, the first backward), 2 blocks gathered (a stage's blocks with reshard_after_forward=false or under pp, whose stages keep
    them gathered between backwards) + 2 blocks of unsharded gradients; with gradient accumulation FSDP2 keeps the
    whole unsharded gradient (4a) between micro-batches; ddp: +4a of buckets when gradient_as_bucket_view=false
  moved: tp: 6 all-reduces of E per block per micro-batch (out_proj, proj outputs; q, k, v, fc input gradients, as parallel/tp.py
    shards q/k/v apart), or with sequence parallel 4 all-gathers + 4 reduce-scatters of E (2/3 of those bytes) plus the
    LayerNorm gradients, Partial after backward and all-reduced once; vocabulary-parallel: the
    embedding's all-reduce, the head input's gradient, loss_parallel's 3 bs reductions; pp: activations forward and gradients backward, E per stage
    boundary per micro-batch, plus the tied embedding's gradient all-reduce between the first and last stage
  bubble: (p-1)/(m+p-1) (gpipe, 1f1b), (p-1)/(v m+p-1) interleaved, zero-bubble: torch's action lists played out (weight passes fill most of it)
  step: slowest rank's 3 x forward FLOPs (+1 forward with checkpointing) / (efficiency x peak) + bubble + communication
       not hidden (latency per ring step + bytes / link bandwidth, FSDP2's x fsdp_byte_time where measured; DDP buckets and
       FSDP2 overlap compute, tp and pp do not)
       + AdamW's 32 B per element / memory bandwidth; MFU = (6N + 12Lhs) x tokens/s / (peak x ranks): docs/planner.md#step-time
  measured against these: docs/planner.md (every layout, benchmarks/strategy_report.py), docs/layouts.md#bytes-on-the-wire"""


HEADER = ["", "layout", "mb x M", "params", "grads", "Adam", "act (x in flight)", "buf+tmp", "peak", "fits",
          "all-reduce", "red-scatter", "all-gather", "p2p", "tp", "bubble", "step", "tokens/s", "MFU"]
MOVED_COLUMNS = ("all-reduce", "reduce-scatter", "all-gather", "send-recv", "tp")  # Collective.kind
REFUSALS_SHOWN = 6


def render(pl: Plan, explain: bool = False, width: int | None = None) -> str:
    """`width` (default terminal_width()): the table is split into as many column groups as it takes
    to fit, each led by the layout's name, and the text lines wrapped."""
    width = width or terminal_width()
    return "\n".join(_fit(line, width) for line in _render(pl, explain, width).split("\n"))


def host_memory_note(host_memory: str, hardware_name: str) -> str | None:
    """On `local` (this CPU) the step times price a step that keeps its freed memory for the next
    one (trainer.host_memory=reuse: benchmarks/strategy_report.py measures the model so); a config
    left lean maps its large temporaries afresh and faults them in every step, which no term prices."""
    if hardware_name != "local" or host_memory == "reuse":
        return None
    return (f"note: the step times price a CPU step that keeps its memory (trainer.host_memory=reuse); with "
            f"trainer.host_memory={host_memory} every freed block of 1 MiB or more goes back to the kernel and is "
            f"faulted in again each step, measured at 1.29-1.48x the plan (4 x 256, 2 processes: docs/planner.md); "
            f"add trainer.host_memory=reuse where host memory is not the limit")


def terminal_width() -> int:
    """$COLUMNS when set, else the width of the terminal sys.stdout writes to; not a terminal (a file,
    a pipe, a test's capture): unlimited, one line per row."""
    try:
        return max(20, int(os.environ["COLUMNS"]))
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 10**6
    except (OSError, ValueError, AttributeError):  # no file descriptor (a StringIO)
        return 10**6


def _fit(line: str, width: int) -> str:
    """A text line wrapped at `width`, its continuation indented as it was plus two spaces."""
    if len(line) <= width:
        return line
    indent = " " * (len(line) - len(line.lstrip()))
    return "\n".join(textwrap.wrap(line, width, subsequent_indent=indent + "  ", break_on_hyphens=False))


def _render(pl: Plan, explain: bool, width: int) -> str:
    lines = [_model_line(pl)]
    if pl.configured_error:
        lines.append(f"configured layout refused on {pl.world_size} ranks: {pl.configured_error}")
    if pl.layouts:
        lines += _table(HEADER, [_row(lp) for lp in pl.layouts], width)
    else:
        lines.append(f"no layout runs on {pl.world_size} ranks; the reasons, the one that blocks the most layouts first:")
    if not pl.layouts or explain:
        lines += refusal_groups(pl.refused)
    lines += pl.advice
    order = "fitting layouts first, fastest first" if pl.hardware else "fitting layouts first, smallest peak first"
    lines.append(f"* configured layout; {len(pl.layouts)} layouts shown ({order}), {len(pl.refused)} refused "
                 f"(--plan-json lists why); buf+tmp: communication buffers and transients (logits at the loss, a recomputed block); "
                 f"bytes moved per rank per optimizer step, busiest rank")
    if pl.layouts:
        lines.append(built_line(pl.layouts[0]))
        lines += [cp_line(lp, pl.model["block_size"]) for lp in pl.layouts[:1] if lp.layout.cp > 1]
    if explain and pl.layouts:
        lines += explain_time(pl.layouts[0])
    lines.append(EXPLAIN if explain else LEGEND)
    return "\n".join(lines)


def built_line(lp: LayoutPlan) -> str:
    """What the first row holds while the model is built and loaded (no rank builds the whole model)."""
    m, ddp = lp.memory, lp.layout.strategy.value == "ddp" and lp.layout.grad_ranks > 1
    return (f"built: {display_name(lp)} allocates {fmt_bytes(m.construction)} on its fullest rank's device while the "
            f"model is built and loaded (its share of the fp32 parameters{' + DDP buckets' if ddp else ''}), and "
            f"{fmt_bytes(m.construction_host)} of host memory for the largest whole initial value (on a CPU: both)")


def cp_line(lp: LayoutPlan, block_size: int) -> str:
    """The first row's context parallelism: what its attention sends, and each cp rank's attention
    work (planner/compute.py attention_flops) beside what a plain split of the sequence would give."""
    cp = next(c for c in lp.collectives if c.kind == "cp")
    work, n = lp.attention_flops_per_cp_rank, lp.layout.cp
    plain = causal_pairs((n - 1) * block_size // n, block_size // n) / causal_pairs(0, block_size // n)
    return (f"cp: {display_name(lp)} sends {fmt_bytes(cp.moved_bytes)} per rank per step for attention "
            f"({lp.layout.cp_mode}: {cp.formula}, {cp.calls} calls); causal attention forward "
            f"{min(work) / 1e9:.4g} to {max(work) / 1e9:.4g} GFLOP per cp rank per step on {n} ranks (chunks i and "
            f"2cp-1-i; a plain split of the sequence would give the last rank {plain:.3g}x the first's)")


def refusal_groups(refused: dict[str, str]) -> list[str]:
    """Refusals grouped by reason (numbers aside: 'not divisible by the 6 data-parallel ranks' and
    'by the 12' are one reason), the reason that refuses the most layouts first."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for label, reason in refused.items():
        groups.setdefault(re.sub(r"\d+", "#", reason), []).append((label, reason))
    ranked = sorted(groups.values(), key=len, reverse=True)
    lines = [f"  refused {len(g)} x: {g[0][1]} (e.g. {', '.join(label for label, _ in g[:3])})"
             for g in ranked[:REFUSALS_SHOWN]]
    if len(ranked) > REFUSALS_SHOWN:
        lines.append(f"  ... and {len(ranked) - REFUSALS_SHOWN} more reasons (--plan-json lists every one)")
    return lines


def explain_time(lp: LayoutPlan) -> list[str]:
    """Each term of the first row's predicted step time (planner/timing.py)."""
    t = lp.time
    if t is None:
        return []
    lines = [f"step time of {display_name(lp)} on {t.hardware}: {t.step_s * 1e3:.4g} ms = the exposed seconds below"]
    for term in t.terms:
        hidden = f" ({term.seconds * 1e3:.4g} ms, the rest hidden behind compute)" if term.exposed < term.seconds else ""
        lines.append(f"  {term.name:<44} {term.exposed * 1e3:>10.4g} ms{hidden}: {term.formula}")
    return lines


def display_name(lp: LayoutPlan) -> str:
    """The layout's name; one row for two engines that give the same layout: 'zero-3=fsdp dp8'."""
    if not lp.aliases:
        return lp.name
    head, _, rest = lp.name.partition(" ")
    return f"{'='.join([head, *lp.aliases])} {rest}".strip()


def _model_line(pl: Plan) -> str:
    m = pl.model
    memory = ""
    if pl.device_memory:
        memory = f" | device memory {fmt_bytes(pl.device_memory)}" + \
            (f" - {fmt_bytes(pl.reserve)} runtime reserve" if pl.reserve else "")
    return (f"model: {m['n_layer']} layers x {m['n_embd']} wide, {m['n_head']} heads, block {m['block_size']}, "
            f"vocab {m['vocab_size']} ({m['vocab_source']}), {m['parameters']:,} parameters | "
            f"global batch {m['global_batch']}, {m['precision']} | world {pl.world_size}" + memory
            + (f"\nhardware: {pl.hardware}" if pl.hardware else ""))


def _row(lp: LayoutPlan) -> list[str]:
    mem, mv, t = lp.memory, lp.moved_bytes_per_rank, lp.time
    fits = "-" if lp.fits is None else ("yes" if lp.fits else "NO")
    return ["*" if lp.configured else "", display_name(lp), f"{lp.layout.micro_batch_size} x {lp.layout.microbatches}",
            fmt_bytes(mem.params), fmt_bytes(mem.grads), fmt_bytes(mem.optimizer),
            f"{fmt_bytes(mem.activations)} (x{mem.inflight_microbatches:g})", fmt_bytes(mem.buffers + mem.transient),
            fmt_bytes(mem.peak), fits,
            *(fmt_bytes(mv[k]) if mv.get(k) else "-" for k in MOVED_COLUMNS),
            f"{lp.bubble:.2f}" if lp.layout.pp > 1 else "-",
            fmt_seconds(t.step_s) if t else "-", f"{t.tokens_per_s:,.0f}" if t else "-",
            f"{t.mfu:.1%}" if t else "-"]


def fmt_seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _table(header: list[str], rows: list[list[str]], width: int = 10**6) -> list[str]:
    """Columns as wide as their widest cell; the marker and the layout name left-aligned, numbers right.
    Wider than `width`: in groups of columns that fit, each led by the marker and the name, a blank
    line between groups (the marker and name alone may still exceed a very narrow width)."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    groups, lead = [[]], widths[0] + 2 + widths[1]
    for i in range(2, len(header)):
        used = lead + sum(2 + widths[j] for j in groups[-1])
        if groups[-1] and used + 2 + widths[i] > width:
            groups.append([])
        groups[-1].append(i)
    lines = []
    for group in groups:
        columns = [0, 1, *group]
        lines += [""] if lines else []
        lines.append("  ".join(header[i].ljust(widths[i]) for i in columns).rstrip())
        for r in rows:
            lines.append("  ".join(str(r[i]).ljust(widths[i]) if i < 2 else str(r[i]).rjust(widths[i])
                                   for i in columns).rstrip())
    return lines
