"""The Trainer's recorder: ``metrics.jsonl`` (``recsys_dist.train.metrics_writer``), the progress
bar, the profiler trace, the training log's open window and ``summary.json``.

:class:`RunRecorder` keeps the logging window (each step's loss and real rows since the last
``train`` line, and when it opened) and the totals it adds up (``rows_trained``,
``train_seconds``): a :class:`~recsys_dist.train.trainer.Trainer` adds each step to it and asks
it for a ``train`` line every ``train.log_every_n_steps``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from recsys_dist.distributed.env import DistContext, broadcast_result
from recsys_dist.files import write_atomic
from recsys_dist.train.metrics_writer import MetricsWriter
from recsys_dist.train.observe import TraceWriter
from recsys_dist.train.summary import run_summary, train_window


def progress_bar(total: int | None, show: bool) -> tqdm:
    """The training progress bar (steps); ``show``: rank 0 with ``train.progress_bar``."""
    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, leave=False, disable=not show)


class RunRecorder:
    """What a run writes as it trains, on one rank (rank 0 writes the files).

    Args:
        run_dir: the run directory (``metrics.jsonl``, ``summary.json``).
        ctx: this rank's place in the job.
        resume_step: the step of the checkpoint resumed from (``metrics.jsonl`` is cut there), or None.
        total_steps: the progress bar's length (None: unknown, a stream).
        show_bar: ``train.progress_bar``.
        profile_dir: ``Trainer(profile_dir=...)``.

    Attributes:
        writer: the ``MetricsWriter`` of ``metrics.jsonl``. bar: the progress bar. tracer: the profiler trace.
        losses, real_rows: each step's loss and sample weights ``[B]`` in the open window.
        rows_trained, train_seconds: real rows over all ranks and seconds trained, so far.
    """

    def __init__(
        self,
        run_dir: Path,
        ctx: DistContext,
        resume_step: int | None,
        total_steps: int | None,
        show_bar: bool,
        profile_dir: Path | None,
    ) -> None:
        self.run_dir, self.ctx = run_dir, ctx
        self.writer = MetricsWriter(run_dir / "metrics.jsonl", ctx.is_main, ctx.world_size, resume_step)
        self.tracer = TraceWriter(profile_dir, ctx.rank)
        self.rows_trained, self.train_seconds = 0, 0.0
        self.losses: list = []
        self.real_rows: list = []
        self.window_seconds = 0.0  # seconds of the logging window before a resume (a stream's)
        self.t0 = time.perf_counter()
        self.bar = progress_bar(total_steps, ctx.is_main and show_bar)

    def write(self, **record) -> None:
        """One ``metrics.jsonl`` line (rank 0; every rank calls it)."""
        self.writer.write(**record)

    def start(
        self, step: int, epoch: int, ledger_line: Callable[[], dict], stale: Callable[[dict], bool] | None = None
    ) -> None:
        """Cut ``metrics.jsonl`` to ``step`` (lines past it, and lines of it that ``stale``
        picks, are written again) and write the ``ledger_line()`` when it differs from the run's last."""
        ctx = self.ctx
        # Lines past the step this run starts from (all of them when it starts from scratch)
        # are written again: each (split, step) once, whatever restarted the run.
        broadcast_result(ctx, lambda: self.writer.start(step, stale))
        ledger = ledger_line()

        # The bytes one step moves (recsys_dist.distributed.ledger): written when it differs from the
        # run's last ledger line (a first start, or a resume on another plan or world size),
        # so a resumed run leaves the same lines as an uninterrupted one.
        def ledger_changed() -> bool:
            last = self.writer.last("ledger")
            return last is None or {k: last.get(k) for k in ledger} != ledger

        if broadcast_result(ctx, ledger_changed):
            self.writer.write(split="ledger", step=step, epoch=epoch, **ledger)

    def open_window(self) -> None:
        """Training starts (again): a window a checkpoint carried over (a stream stopped inside
        it) counts its seconds too."""
        self.t0, self.window_seconds = time.perf_counter() - self.window_seconds, 0.0

    def restart_clock(self) -> None:
        """Seconds from now on count as training (after a validation or a checkpoint)."""
        self.t0 = time.perf_counter()

    def add_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss)

    def add_rows(self, weights: torch.Tensor) -> None:
        self.real_rows.append(weights)  # the weights [B]; summed once per log line, not per step
        self.bar.update(1)

    def log_train(
        self, step: int, epoch: int, tasks: list[str], fields: Callable[[], dict], diverged: Callable[[], None]
    ) -> None:
        """The ``train`` line of the window: global mean loss and samples/s since the last one
        (one all_reduce), then ``fields()`` (the step runner's, the model's); ``diverged()``
        raises when the loss is not finite (the same on every rank)."""
        elapsed = time.perf_counter() - self.t0
        loss, per_task, rows = train_window(self.losses, self.real_rows, self.ctx.world_size, tasks)
        if not math.isfinite(loss):  # identical on every rank (all-reduced), so all stop here
            diverged()
        sps = round(rows / elapsed, 1) if elapsed > 0 else None
        self.writer.write(split="train", step=step, epoch=epoch, loss=loss, **per_task, samples_per_s=sps, **fields())
        self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=sps, refresh=False)
        self.train_seconds += elapsed
        self.rows_trained += rows
        self.losses, self.real_rows = [], []
        self.t0 = time.perf_counter()

    def write_summary(self, summary: dict) -> dict:
        """``summary.json`` (rank 0); returns ``summary``."""
        if self.ctx.is_main:
            write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        return summary

    def summary(
        self,
        steps: int,
        resumed_at_step: int | None,
        validation: dict,
        test: dict,
        checkpoint: Path | None,
        best,
        keep_best: bool,
        wall: dict,
        weights_step: int | None = None,
    ) -> dict:
        """``recsys_dist.train.summary.run_summary`` of the run so far (its arguments)."""
        return run_summary(
            self.run_dir,
            self.ctx.world_size,
            steps,
            self.rows_trained,
            self.train_seconds,
            resumed_at_step,
            validation,
            test,
            checkpoint,
            best,
            keep_best,
            wall,
            weights_step=steps if weights_step is None else weights_step,
        )

    def close(self) -> None:
        for part in (self.bar, self.tracer, self.writer):
            part.close()
