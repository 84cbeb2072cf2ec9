"""The Trainer: the step loop, LR schedule, mixed precision, eval, logging, snapshots.

It talks to the model only through a `parallel.Strategy` and never asks which strategy it is.
`trainer.batch_size` is the GLOBAL batch (sequences per optimizer step); the strategy splits it
over data-parallel ranks and micro-batches. One optimizer step is:

    loss = strategy.forward_backward(x, y, scaler.scale)   # grads averaged over the global batch
    scaler.unscale_(opt); norm = strategy.clip_grad_norm_(clip); scaler.step(opt); scaler.update()
    scheduler.step()

Resume state (`state_tensors` + `state_meta`): model, optimizer, grad scaler, step (which is also
the data position: batches are a pure function of (seed, step)), RNG states, and the run
tracker's id. Snapshot files are snapshots/store.py's business, which launches are the same run
snapshots/resume.py's. A resume runs the configured optimizer hyper-parameters and LR schedule
from the resume step, and restores the RNG streams only into the same (pp, dp, tp) layout (else
derives them per dp rank, so tp peers share one).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from char_dataset import Batching, TokenDataset
from config import Config, UsageError
from launch.schedule import lr_at, schedule_change, total_steps
from launch.stop_vote import StopVote
from launch.stopping import StopRequest
from launch.watchdog import HangWatchdog
from model import ModelCost
from observe import hooks
from observe.health import FiniteCheck
from observe.perf import Peak, set_fp32_matmul_mode
from observe.profiling import StepProfiler
from observe.replicas import check_replicas
from observe.step_metrics import CudaPeaks, RunSummary, StepWindow, memory_row
from observe.stragglers import GpuBlockClock, StragglerWatch
from observe.tracker import NullTracker, Progress, RunTracker
from parallel.strategy import OPTIMIZER_KERNEL_KEYS, Strategy
from snapshots.meta import SnapshotMeta
from snapshots.model_file import ModelFile, write_model_file
from snapshots.resume import nothing_left_message, refuse_another_run, rng_state, set_rng_state
from snapshots.store import SnapshotManager


def seed_rng(seed: int, step: int, dp_rank: int) -> None:
    """Seed the CPU and every CUDA generator (what dropout draws from) from (seed, step, dp rank).
    Not from the global rank: tensor-parallel peers must draw the same dropout masks, since tp
    treats the activations they drop as replicated (different masks make replicated parameters
    such as LayerNorm weights drift apart silently). Pipeline stages of one dp rank share it too
    (they drop different activations)."""
    torch.manual_seed(seed + 1 + dp_rank + 1_000_003 * step)


class Trainer:
    def __init__(self, cfg: Config, data: TokenDataset, tokenizer, strategy: Strategy, run_dir: Path,
                 model_config: dict, model_cost: ModelCost, data_source: str = "", init_from: Path | None = None):
        """Collective (the tracker rank shares its peak FLOP/s). `strategy` holds the model already
        (Strategy.setup); `model_cost`: what the whole model costs, counted before the split;
        `data_source`: where the corpus came from (for the start-up view); `init_from`: the weights
        file the model was loaded from (model.init_from), None for a seeded init."""
        self.cfg, self.data, self.tokenizer, self.strategy, self.run_dir = cfg, data, tokenizer, strategy, run_dir
        self.model_config, self.model_cost = model_config, model_cost  # model_config: GPTConfig as a dict
        self.data_source, self.init_from = data_source, init_from
        self.max_steps = total_steps(cfg, data)
        data.check_batch(cfg.trainer.batch_size)
        self.batching = Batching(cfg.trainer.batch_size, strategy.dp_rank, strategy.dp_size)
        self.optimizer = strategy.build_optimizer()
        self._lr_factor = lambda s: lr_at(s, cfg, self.max_steps) / cfg.optimizer.lr
        self.scheduler = LambdaLR(self.optimizer, self._lr_factor)
        self.scaler = strategy.make_grad_scaler()
        self.step = 0
        self.tracker = NullTracker()
        self.tracker_run_id: str | None = None
        self.snapshots = SnapshotManager(run_dir, cfg.trainer.keep_snapshots, strategy.env.rank,
                                         strategy.env.distributed, background=cfg.trainer.async_save)
        set_fp32_matmul_mode(strategy.device)  # before the peak: it assumes this mode
        self.peak = Peak(strategy.device, strategy.compute_precision, cfg.trainer.peak_flops, strategy.is_tracker)
        self.peak_label = self._tracker_peak_label()
        self.held_bytes: dict[str, int] = {}  # Strategy.resident_bytes, read on log steps
        self.cuda_peaks = CudaPeaks()  # the allocator's peak per log window (reset after each) and over the run
        self.last_val_loss: float | None = None
        self.last_snapshot: Path | None = None  # the newest snapshot this launch resumed from or wrote
        self.resumed_from: Path | None = None  # the snapshot resume() loaded
        self.stop_request = StopRequest()
        self.schedule_note: str | None = None  # set by resume() when the LR schedule runs differently
        self.rng_note: str | None = None  # set by resume() when the snapshot lacks some generator's state
        self._snapshot_decay: int | None = None  # the cosine length the resumed snapshot was trained with
        self.finite = FiniteCheck(strategy)
        env = strategy.env  # launch/app.py runs resume and train() inside self.watchdog.watching(step)
        self.watchdog = HangWatchdog(cfg.trainer.hang_timeout_s, env.rank, env.world_size, env.local_rank,
                                     env.distributed, run_dir)
        self.profiler = StepProfiler(cfg.trainer.profile, run_dir, env.rank, strategy.device, self.max_steps)
        gpu_clock = GpuBlockClock([b for part in strategy.unwrapped() for b in getattr(part, "blocks", {}).values()]) \
            if strategy.device.type == "cuda" else None  # a GPU's own time: observe/stragglers.py
        self.stragglers = StragglerWatch(env.rank, env.world_size, env.local_rank, env.distributed, strategy.is_tracker,
                                         gpu_clock)

    def _tracker_peak_label(self) -> str:
        """The peak is looked up on the tracker rank only (it may measure); every rank learns its label."""
        shared = [self.peak.label]
        if self.strategy.env.distributed:
            dist.broadcast_object_list(shared, src=self.strategy.tracker_rank)
        return shared[0]

    # ------------------------------------------------------------------ resume state

    def _rng_key(self, device: str) -> str:
        """DCP key (under "rng") of this rank's generator state of `device` (cpu or cuda)."""
        return f"rank{self.strategy.env.rank}" + ("" if device == "cpu" else f"_{device}")

    def state_tensors(self) -> dict:
        state = self.strategy.state_dict(self.optimizer)
        state["rng"] = {self._rng_key(dev): t for dev, t in rng_state(self.strategy.rng_gpus).items()}
        return state

    def data_stream(self) -> dict:
        """What fixes which tokens are trained on, in which order, and which are held out for
        validation (batches are a pure function of these and the step): a resume must keep them."""
        c = self.cfg
        return {"corpus_sha256": self.data.digest, "data.truncate": c.data.truncate,
                "data.val_fraction": c.data.val_fraction, "data.tokenizer": c.data.tokenizer,
                "trainer.seed": c.trainer.seed, "trainer.batch_size": c.trainer.batch_size,
                "model.block_size": c.model.block_size}

    def layout(self) -> dict:
        lay = self.strategy.layout
        return {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp}

    def state_meta(self) -> SnapshotMeta:
        return SnapshotMeta(
            step=self.step, config=self.cfg.to_dict(), model_config=self.model_config,
            tokenizer=self.tokenizer.to_dict(), fingerprint=self.cfg.model_fingerprint(),
            data_position={"step": self.step, **self.data_stream()},
            world_size=self.strategy.env.world_size, strategy=self.cfg.parallel.strategy, mesh=self.layout(),
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            tracker_run_id=self.tracker_run_id)

    def save_snapshot(self) -> Path:
        self.last_snapshot = self.snapshots.save(self.step, self.state_tensors(), self.state_meta())
        return self.last_snapshot

    def resume(self) -> SnapshotMeta | None:
        """Load the newest valid snapshot according to trainer.resume (its path becomes
        `last_snapshot`); returns its record, or None when this launch starts at step 0."""
        mode = self.cfg.trainer.resume
        if mode == "never":
            if self.snapshots.has_any():
                raise UsageError(f"{self.snapshots.snap_dir} already holds snapshots and trainer.resume="
                                 f"never; pick another trainer.run_dir or set trainer.resume=auto")
            return None
        found = self.snapshots.find_latest()
        if found is None:
            if mode == "require":
                raise UsageError(f"trainer.resume=require but {self.snapshots.snap_dir} holds no valid "
                                 f"snapshot; set trainer.resume=auto to start fresh")
            return None
        path, record = found
        meta = SnapshotMeta.from_record(record)
        refuse_another_run(path, meta, self.cfg, self.data_stream())
        # The optimizer hyper-parameters as this config builds them: they, not the snapshot's,
        # run from the resume step on (put back after loading, below; the kernel flags are the
        # strategy's, Strategy.load_state_dict).
        configured = [{k: v for k, v in g.items() if k not in ("params", *OPTIMIZER_KERNEL_KEYS)}
                      for g in self.optimizer.param_groups]
        tensors = self.state_tensors()
        # A rank's saved RNG streams belong to its position in the snapshot's (pp, dp, tp) mesh;
        # in another layout (or world size) that position may hold another role (a dp=2 rank 1
        # becomes a tp=2 peer of rank 0), so the streams are then derived from (seed, step, dp rank).
        stored = self.snapshots.stored_keys(path)
        same_layout = meta.mesh == self.layout() and meta.world_size == self.strategy.env.world_size
        if not same_layout or not all(f"rng.{k}" in stored for k in tensors["rng"]):
            keys = sorted(tensors.pop("rng"))
            if same_layout:  # same layout, other generators: e.g. nn.DataParallel on another GPU count
                self.rng_note = (f"note: {path} holds no random-number state for every generator of this launch "
                                 f"({', '.join(keys)}); dropout's streams "
                                 f"restart from trainer.seed and the step, so this run's masks differ from an "
                                 f"uninterrupted run's")
        self.snapshots.load(path, tensors, record)  # the record rank 0 validated and broadcast
        self.strategy.load_state_dict(tensors, self.optimizer)
        if self.scaler is not None and meta.scaler:
            self.scaler.load_state_dict(meta.scaler)
        self.step = meta.step
        # The snapshot's param groups carry the lr, betas and weight decay it was trained with. Put
        # back the configured ones and rebuild the schedule at this step (it is a pure function of
        # the step), so what runs is what config.yaml says.
        for group, mine in zip(self.optimizer.param_groups, configured):
            group.update(mine)
        self.scheduler = LambdaLR(self.optimizer, self._lr_factor, last_epoch=self.step - 1)
        if "rng" in tensors:
            gpus = self.strategy.rng_gpus
            set_rng_state({dev: tensors["rng"][self._rng_key(dev)] for dev in rng_state(gpus)}, gpus)
        else:
            seed_rng(self.cfg.trainer.seed, self.step, self.strategy.dp_rank)
        self.tracker_run_id = meta.tracker_run_id
        self.last_snapshot = self.resumed_from = path
        self.schedule_note, self._snapshot_decay = schedule_change(self.cfg, self.data, meta, self.step, self.max_steps)
        return meta

    def nothing_left_message(self) -> str:
        """The one line of a launch that resumed at or past its last step (main exits 0 after it)."""
        decay = self._snapshot_decay or self.cfg.optimizer.lr_decay_steps or self.max_steps
        return nothing_left_message(self.cfg, self.run_dir, self.step, self.max_steps, decay)

    # ------------------------------------------------------------------ tracking

    def open_tracker(self) -> None:
        """Collective; call after resume(). The tracker rank starts the run tracker (metrics.jsonl,
        and wandb: a resume continues the snapshot's wandb run); every rank learns the run id, which
        the snapshots record."""
        s = self.strategy
        if s.is_tracker:
            self.tracker = RunTracker(self.cfg, self.run_dir,
                                      resume_step=self.step if self.resumed_from else None,
                                      resume_run_id=self.tracker_run_id)
        shared = [self.tracker.run_id]
        if s.env.distributed:
            dist.broadcast_object_list(shared, src=s.tracker_rank)
        self.tracker_run_id = shared[0]

    def close_tracker(self, summary: RunSummary | None = None, sample: str | None = None) -> None:
        """End the tracker's run (on the tracker rank), with the run's summary and sample text."""
        if sample is not None:
            self.tracker.log_text("sample", sample)
        if summary is not None:
            self.tracker.summary(summary.metrics())
        self.tracker.finish()

    # ------------------------------------------------------------------ loop

    def evaluate(self) -> float:
        for part in self.strategy.unwrapped():
            part.eval()
        total = torch.zeros((), device=self.strategy.device)
        n = 0
        for x, y in self.data.val_batches(self.cfg.trainer.eval_batches, self.batching):
            total += self.strategy.eval_loss(x, y)
            n += 1
        for part in self.strategy.unwrapped():
            part.train()
        return float(self.strategy.reduce_mean(total / n))

    def forward_backward(self) -> torch.Tensor:
        """Gradients of the global batch of self.step (this rank's share); returns the rank's loss."""
        x, y = self.data.train_batch(self.step, self.batching)
        if self.strategy.device.type == "cuda":  # page-locked: the copies to the GPU run asynchronously (non_blocking)
            x, y = x.pin_memory(), y.pin_memory()
        scale = self.scaler.scale if self.scaler is not None else (lambda l: l)
        return self.strategy.forward_backward(x, y, scale)

    def optimizer_step(self) -> torch.Tensor:
        """Unscale (fp16), clip, step, advance the schedule. Returns the pre-clip grad norm."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        norm = self.strategy.clip_grad_norm_(self.cfg.trainer.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped if any gradient is inf/nan
            self.scaler.update()
        else:
            self.optimizer.step()
        self.strategy.after_optimizer_step()
        if self._is_log_step(self.step + 1):  # all of params, grads and optimizer state exist now
            self.held_bytes = self.strategy.resident_bytes(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return norm

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the global batch of self.step. Returns (loss, grad norm)."""
        with self.stragglers.timed(), self.profiler.around(self.step):  # observe/stragglers.py, observe/profiling.py
            loss = self.forward_backward()
            return loss, self.optimizer_step()

    def _is_eval_step(self, step: int) -> bool:
        """Every trainer.eval_every steps and at the last; never with eval_every = 0."""
        every = self.cfg.trainer.eval_every
        return bool(every) and (step % every == 0 or step == self.max_steps)

    def _is_log_step(self, step: int) -> bool:
        return step % self.cfg.trainer.log_every == 0 or step == self.max_steps

    def _step_seconds(self, t0: float) -> float:
        """Seconds since t0 for the step just done. CUDA kernels run after the host returns: before
        the clock is read at a step that ends a log window or precedes eval/save, wait for them
        (one synchronize per window), so each window's time holds all of its GPU work."""
        t, step = self.cfg.trainer, self.step
        if self.strategy.device.type == "cuda" and (
                self._is_log_step(step) or self._is_eval_step(step) or (t.save_every and step % t.save_every == 0)):
            torch.cuda.synchronize(self.strategy.device)
        return time.perf_counter() - t0

    def _save_checked(self) -> Path:
        self.finite.check(self.step, self.last_snapshot, params=True)  # never snapshot a diverged state: it would become the resume point
        check_replicas(self.strategy, self.optimizer, self.step, self.last_snapshot)  # nor a silently corrupted one
        with self.watchdog.phase("snapshot"):
            return self.save_snapshot()

    def train(self) -> RunSummary:
        """The step loop. When `self.stop_request` records a signal, every rank stops after the same
        step and saves a snapshot of it (the summary's `stopped` and `snapshot`). Raises
        NonFiniteError (on every rank) instead of saving a non-finite state."""
        t, s = self.cfg.trainer, self.strategy
        progress = Progress(self.max_steps, self.step, enabled=s.is_tracker)
        window, tokens_per_sec = StepWindow(), 0.0
        vote = StopVote(self.stop_request, s.env.distributed)
        stopped, snapshot = 0, None
        hooks.at("train", self.step, s.env.rank)  # built, resumed, nothing of the first step run yet
        while self.step < self.max_steps:
            t0 = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0]
            loss, norm = self.train_step()
            hooks.after_update(self.step, s.env.rank, s.unwrapped()[0])
            self.watchdog.beat(self.step)
            self.finite.note_loss(loss, self.step)
            window.add(self._step_seconds(t0))  # train step only: eval/save excluded
            last = self.step == self.max_steps
            stop = vote.result()
            row = self._log_row(loss, norm, lr, window) if self._is_log_step(self.step) else {}
            if row:
                tokens_per_sec = row["tokens_per_sec"]
                progress.update(self.step, row)
            if self._is_eval_step(self.step):
                with self.watchdog.phase("evaluation"):
                    self.last_val_loss = row["val_loss"] = self.evaluate()
                progress.message(f"step {self.step}: val loss {self.last_val_loss:.4f}")
            if row:
                self.tracker.log(self.step, row)
            if (t.save_every and self.step % t.save_every == 0) or last or stop:
                snapshot = self._save_checked()
            if stop and not last:
                stopped = stop
                break
            if not last:
                vote.start()
        self.snapshots.finish_background()  # the final or stop snapshot is committed before the closing line
        progress.close()
        if stopped:
            return RunSummary(self.step, stopped=stopped, snapshot=str(snapshot))
        if self.last_val_loss is None and t.eval_every:  # resumed at max_steps: nothing trained, still report it
            self.last_val_loss = self.evaluate()
        return RunSummary(self.step, val_loss=self.last_val_loss, median_step_ms=1000 * window.median(),
                          tokens_per_sec=tokens_per_sec)

    def _log_row(self, loss: torch.Tensor, norm: torch.Tensor, lr: float, window: "StepWindow") -> dict:
        """Collective. The metrics of a log step: the loss averaged over ranks, speed over the
        window since the last log step, memory (max over ranks). Checks the loss is finite first."""
        s = self.strategy
        self.finite.check(self.step, self.last_snapshot, params=False)
        check_replicas(s, self.optimizer, self.step, self.last_snapshot)  # cheap: ~14 GB/s per CPU thread
        seconds = window.close()
        tokens_per_sec = self.cfg.trainer.batch_size * self.cfg.model.block_size / seconds
        return dict(loss=float(s.reduce_mean(loss)), lr=lr, grad_norm=float(norm), tokens_per_sec=tokens_per_sec,
                    mfu=self.peak.mfu(self.model_cost.flops_per_token, tokens_per_sec, s.num_devices),
                    step_time_ms=1000 * seconds, **memory_row(s, self.held_bytes, self.cuda_peaks), **self.stragglers.row(self.step),
                    **self.snapshots.pop_timing())

    # ------------------------------------------------------------------ outputs

    def write_model(self, path: Path, sd: dict) -> None:
        """model.pt of these weights (snapshots/model_file.py: whole or not at all)."""
        write_model_file(path, ModelFile.from_snapshot(self.state_meta(), sd))
