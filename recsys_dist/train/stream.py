"""Online training: a :class:`StreamTrainer` trains on partitions as they land (``data.stream``).

The run waits for files under ``data.stream.path`` (``recsys_dist.data.stream``) and takes
them one at a time, in name order. For each partition: rank 0 converts it (a malformed one is
quarantined: named in the log and in ``metrics.jsonl``, and training goes on), every rank
opens its share, the model scores it before training on it (progressive validation: a
``validation`` line naming the partition), trains on every row once, writes a ``partition``
line (rows, rows skipped, steps, seconds, the managed-collision counters of that partition) and saves a
checkpoint. It stops after ``stop_after_idle_seconds`` without a new partition, at
``train.max_steps``, or on SIGTERM (after a checkpoint, exit 0); else it waits forever.

Landing: a file is taken once it has stopped changing (``data.stream.min_file_age_seconds``,
or ``data.stream.marker``); one that changes while it is read is taken again later. A trained
partition whose file changes afterwards is warned about by name, once a run (it is not trained
again); a quarantined one whose file changes is tried again.

Exactly once: a checkpoint records the partitions consumed, the partition being trained and
the global batches of it done (``meta.json`` ``stream``; quarantines and empty partitions
since its step beside it, ``recsys_dist.train.stream_state``), so a resume (``--resume auto``
after a kill anywhere) neither skips nor repeats a row; ``metrics.jsonl`` lines after the
checkpoint's step, and lines of its own step that it does not account for (a partition
scored after it was saved), are written again; a SIGTERM inside a logging window carries the
window over. The global batch (``train.batch_size`` x ranks) may change only at a partition
boundary: the order of a partition's rows is that of its global batches (docs/online.md).
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.dcp import latest_checkpoint
from recsys_dist.data.stream import Partition, convert_partition, not_ready_reason, ready, scan
from recsys_dist.distributed.env import broadcast_result
from recsys_dist.errors import DataError, FileChanging
from recsys_dist.faults import maybe_fault
from recsys_dist.models.managed import managed_counters, managed_metrics
from recsys_dist.train.build import Loaders, make_loaders
from recsys_dist.train.results import StreamSummary
from recsys_dist.train.stream_state import StreamState, open_window, record_between, restored_state, resume_window
from recsys_dist.train.trainer import Trainer

log = logging.getLogger("recsys_dist")
STOP_CHECK_STEPS = 8  # a SIGTERM stops training within this many steps
PARTITIONS_DIR = "partitions"  # RUN_DIR/partitions: each partition's Parquet until it is trained
__all__ = ["StreamState", "StreamTrainer"]


class StreamTrainer(Trainer):
    """A :class:`~recsys_dist.train.trainer.Trainer` over ``data.stream``: same arguments,
    same model, sharding, checkpoints and metrics; :meth:`fit` trains on partitions as they
    land instead of epochs over ``data.raw_path``. ``recsys-dist train`` uses it when the config
    has ``data.stream``. Every rank builds one and calls :meth:`fit` (collective).

    Callbacks also get ``on_partition_end`` after each partition and ``on_resume`` after a
    resume, before training (``PublishCallback`` publishes the resumed checkpoint when a kill
    cut its publish short).

    Attributes (besides the Trainer's):
        stream: the :class:`StreamState` (partitions consumed, quarantined, the current one).

    Raises:
        ConfigError: as the Trainer; a resume mid-partition with another global batch.
        CheckpointError: ``resume`` names a checkpoint of a run that was not a stream.
    """

    # ------------------------------------------------------------------ set-up (Trainer hooks)

    def _setup_data(self, checkpoint: Path | None) -> None:
        job, ctx = self.job, self._ctx
        path = str(Path(job.data.stream.path).resolve())
        self.stream = StreamState(global_batch=job.train.batch_size * ctx.world_size, path=path)
        self._loaders = Loaders(None, None, None, self.job.table_sizes)  # one partition's, once open
        self._data, self._new_data = None, False
        self._global_batch = self.stream.global_batch
        self._resume_epoch = self._step_offset = 0
        self.total_steps = job.train.max_steps  # None: as long as data lands
        self._signalled: int | None = None
        self._stop_reason: str | None = None
        self._part_t0 = time.perf_counter()
        self._partition: Partition | None = None  # the partition open (its conversion)
        self._window: dict | None = None  # a logging window a stop leaves open, saved with the checkpoint
        self._noted: set[tuple[str, str]] = set()  # (what, name) said once in the log (rank 0)

    def _done(self) -> bool:
        return self.total_steps is not None and self._step >= self.total_steps

    def _checkpoint_meta(self) -> dict:
        state = asdict(self.stream)
        state["batches"] = self._in_epoch if self.stream.current is not None else 0
        return {**super()._checkpoint_meta(), "stream": state, "window": self._window}

    def _keeps_window(self) -> bool:
        # Stopped inside a partition: the window goes on after the resume, unless an uninterrupted
        # run closes it here too (the partition's end, a checkpoint by cadence).
        inside = self._in_epoch < len(self._loaders.train) and not self._checkpoint_due()
        return self._stop_reason == "SIGTERM" and inside

    def _restore_position(self, path: Path, meta: dict) -> None:
        state = restored_state(path, meta)  # a stream's checkpoint: run_dir.check_stream_resume
        if self._ctx.is_main and state.path is not None and state.path != self.stream.path:
            log.warning(
                "data.stream.path is %s; the checkpoint's run read %s. Partitions are named by their path below it: "
                "the %d name(s) trained there are not trained again here, whatever their content",
                self.stream.path,
                state.path,
                len(state.consumed),
            )
        state.global_batch, state.path = self._global_batch, self.stream.path
        self.stream = state
        self._in_epoch = state.batches
        self.epoch = state.index
        if meta.get("window"):  # stopped inside a logging window: it goes on
            ctx = self._ctx
            self._losses, self._real_rows, self._window_seconds = resume_window(
                meta["window"], ctx.rank, ctx.world_size, ctx.device
            )
        log.info(
            "resumed from %s at step %d: %d partition(s) trained, %s",
            path,
            self._step,
            len(state.consumed),
            f"{state.current} at global batch {state.batches}" if state.current else "between partitions",
        )

    def _start_metrics(self) -> None:
        # config.yaml only once the resume (if any) was accepted: a refused one leaves the
        # config the checkpoints were trained with.
        broadcast_result(self._ctx, lambda: run_dirs.write_config(self.job.to_dict(), self.run_dir))
        # The checkpoint's own step may hold lines of what came after it (a partition scored or
        # quarantined after it was saved): written again, so dropped here.
        self._stale_line = lambda line: line.get("partition") is not None and not self.stream.accounts_for(line)
        super()._start_metrics()

    def _should_stop(self) -> bool:
        """After a training step: every STOP_CHECK_STEPS steps (the same steps on every rank),
        whether to stop (:meth:`_agree_stop`): not every step, which would add a collective to
        each one."""
        return self._step % STOP_CHECK_STEPS == 0 and self._agree_stop()

    def _agree_stop(self) -> bool:
        """Every rank stops when any rank got SIGTERM (one all_reduce)."""
        flag = torch.tensor([1 if self._signalled is not None else 0])
        if self._ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) and self._stop_reason is None:
            self._stop_reason = "SIGTERM"
            log.warning("SIGTERM: stopping after step %d with a checkpoint", self._step)
        return bool(int(flag))

    # ------------------------------------------------------------------ the job

    def fit(self) -> StreamSummary:
        """Train on the partitions of ``data.stream`` as they land, until it has been idle for
        ``stop_after_idle_seconds``, ``train.max_steps``, or SIGTERM; then save a checkpoint
        and write ``summary.json``. Collective.

        Returns:
            The summary (as :meth:`Trainer.fit`, ``test`` empty) with ``partitions`` (names
            trained), ``quarantined`` (name -> error), ``rows_skipped`` and ``skipped`` (bad rows
            left out under ``data.on_bad_row: skip``: the total, and name -> rows) and
            ``stopped`` (``idle``, ``max_steps`` or ``SIGTERM``).
        """
        with self._collective(), self._sigterm_stops():
            last_val: dict = {}
            if self.resumed_from is not None:  # work a kill after the checkpoint cut short catches up
                for callback in self._callbacks:
                    callback.on_resume(self, self._step, self.resumed_from)
            self._idle_since = time.monotonic()
            while not self._done() and self._stop_reason is None:
                name = self._next_partition()
                if name is None or not self._open(name):
                    continue
                if self.job.data.stream.progressive_validation and not self.stream.validated:
                    last_val = self._score_partition()
                with self._clock.phase("train"):
                    self._train_steps(self._in_epoch)
                if self._in_epoch >= len(self._loaders.train):
                    self._finish_partition()
            if self._done() and self._stop_reason is None:
                self._stop_reason = "max_steps"
            return self._summary(last_val)

    def _summary(self, last_val: dict) -> dict:
        self._tracer.close()
        self._bar.close()
        c = self.job.checkpoint
        if self._losses:  # a stop inside a partition: the checkpoint saves the open window
            seconds = time.perf_counter() - self._t0
            self._window = open_window(self._losses, self._real_rows, seconds, self._ctx.world_size)
        path = None
        if c.enabled:
            path = self.save_checkpoint() if self._saved_step != self._step else latest_checkpoint(self.run_dir)
        if self._window is not None:  # trained, though not logged yet: in the summary's numbers
            self.rows_trained += sum(r["rows"] for r in self._window["ranks"])
            self.train_seconds += self._window["seconds"]
            self._losses, self._real_rows, self._window = [], [], None
        s = self.stream
        return self._write_summary(
            last_val,
            {},
            path,
            partitions=list(s.consumed),
            quarantined=dict(s.quarantined),
            rows_skipped=sum(s.skipped.values()),
            skipped=dict(s.skipped),
            stopped=self._stop_reason,
        )

    def _next_partition(self) -> str | None:
        """The partition to train next (the one a checkpoint stopped in, else the first new one
        in name order), waiting ``poll_seconds`` between looks; None to stop (idle, SIGTERM)."""
        if self.stream.current is not None:
            return self.stream.current
        s = self.job.data.stream
        waiting = False
        while True:
            if self._agree_stop():
                return None
            kind, name = broadcast_result(self._ctx, self._look)
            if kind == "take":
                self.stream.quarantined.pop(name, None)  # a quarantined file that changed: tried again
                self.stream.current, self.stream.validated, self._in_epoch = name, False, 0
                return name
            if kind == "wait" and not waiting:
                log.info("data.stream: waiting for a new partition in %s (%s)", s.path, s.pattern)
            waiting = True
            if kind == "idle":
                log.info("data.stream: no new partition for %ss; stopping", s.stop_after_idle_seconds)
                self._stop_reason = "idle"
                return None
            time.sleep(s.poll_seconds)

    def _look(self) -> tuple[str, str | None]:
        """Rank 0: ("take", name) for the first partition due (new, or quarantined and changed)
        once it is ready, ("wait", None) until then or while none is due, or ("idle", None) past
        stop_after_idle_seconds without one."""
        s, state = self.job.data.stream, self.stream
        files = scan(s)
        self._warn_changed(files)
        due = [n for n, file_id in files.items() if state.due(n, file_id)]
        if due:
            name = due[0]  # in name order: a later one waits for it
            if not ready(s, name, files[name]):
                self._note("wait", name, f"data.stream: waiting for partition {name}: {not_ready_reason(s)}")
                return "wait", None
            last = state.consumed[-1] if state.consumed else None
            if name in state.quarantined:
                log.warning("data.stream: quarantined partition %s changed since; trying it again", name)
            elif last is not None and name < last:
                log.warning("data.stream: partition %s landed after %s was trained; training it now", name, last)
            return "take", name
        idle = s.stop_after_idle_seconds
        if idle is not None and time.monotonic() - self._idle_since >= idle:
            return "idle", None
        return "wait", None

    def _open(self, name: str) -> bool:
        """Convert ``name`` (rank 0) and open every rank's loaders of it; False when it was
        quarantined, empty or still changing (then the stream moves on)."""
        ctx, d, state = self._ctx, self.job.data, self.stream

        def convert():
            try:
                return "ok", convert_partition(d, name, self.run_dir / PARTITIONS_DIR)
            except FileChanging as err:
                return "changing", str(err)
            except DataError as err:
                return "bad", (str(err), getattr(err, "file_id", None))

        with self._clock.phase("data"):
            kind, value = broadcast_result(ctx, convert)
            if kind == "ok" and value.rows:  # opening the loaders counts as data, as in a batch run
                self._loaders = make_loaders(self.job.with_data(value.prepared), ctx)
            elif kind == "ok":
                self._loaders = Loaders(None, None, None, self.job.table_sizes)
        if kind == "changing":  # a writer is still at it: taken again once it stops changing
            self._note("changing", name, f"{value}; it is taken once it stops changing")
            if self._in_epoch == 0 and not state.validated:
                state.current = None  # back to looking: it is taken once ready again
            time.sleep(d.stream.poll_seconds)  # (begun, it stays current: tried again, then checked)
            return False
        if kind == "bad":
            state.current = None
            self._quarantine(name, *value)
            return False
        self._partition = value
        self._check_unchanged(name, [value.rows, value.file_id[0]])
        state.files[name] = value.file_id
        self._part_t0 = time.perf_counter()
        if self._in_epoch == 0:
            state.counters_at_start = managed_counters(self._model)
        if value.skipped and ctx.is_main:
            log.warning(
                "data.stream: partition %s: %d bad row(s) skipped (data.on_bad_row: skip); the first: %s",
                name,
                value.skipped,
                value.first_skipped,
            )
        if value.rows == 0:  # 0 bytes, or a header alone: one rule
            log.warning("data.stream: partition %s holds no rows", name)
            self._finish_partition()
            return False
        self.epoch = state.index
        return True

    def _quarantine(self, name: str, error: str, file_id: list[int] | None) -> None:
        """Record ``name`` as malformed (every rank): the log, a ``quarantine`` line, the state
        (with its file, so a changed file is tried again), kept beside this step's checkpoint."""
        log.error("data.stream: partition %s is malformed and was quarantined (%s); training goes on", name, error)
        state = self.stream
        state.quarantined[name] = error
        if file_id is not None:
            state.files[name] = file_id
        self._writer.write(split="quarantine", step=self._step, epoch=state.index, partition=name, error=error)
        self._record_between()

    def _record_between(self) -> None:
        """Keep the state (a quarantine, an empty partition: no training step) with the
        checkpoint of this step, so a resume does not read those partitions again: beside the
        one saved (or resumed from) at this step, else in a new one."""
        if not self.job.checkpoint.enabled:
            return
        if self._saved_step != self._step:
            latest = broadcast_result(self._ctx, lambda: latest_checkpoint(self.run_dir))
            if latest is None or run_dirs.checkpoint_step(latest) != self._step:
                self._save_in_window()
                return
            self._saved_step, self._saved_path = self._step, latest  # resumed from it, nothing trained since
        if self._ctx.is_main:
            record_between(self._saved_path, self._step, self.stream)

    def _warn_changed(self, files: dict[str, list[int]]) -> None:
        """Rank 0: warn, once a run, about each trained partition whose file changed since."""
        recorded = self.stream.files
        for name in self.stream.consumed:
            was, now = recorded.get(name), files.get(name)
            if was is not None and now is not None and was != now:
                self._note(
                    "changed",
                    name,
                    f"data.stream: partition {name} changed after it was trained ({was[0]} bytes, modified "
                    f"{_when(was[1])}; now {now[0]} bytes, modified {_when(now[1])}): it is not trained again "
                    "(a partition is known by its name); land new data under a new name, and let a producer "
                    "rename a finished file into place (docs/online.md)",
                    warn=True,
                )

    def _note(self, what: str, name: str, message: str, warn: bool = False) -> None:
        """Log ``message`` once a run for (``what``, ``name``) (rank 0)."""
        if (what, name) in self._noted or not self._ctx.is_main:
            return
        self._noted.add((what, name))
        (log.warning if warn else log.info)(message)

    def _check_unchanged(self, name: str, now: list) -> None:
        """Refuse to go on inside partition ``name`` when its file changed since the checkpoint
        stopped in it (another row count or size: the batches done were of other rows)."""
        s = self.stream
        if s.current_file is not None and self._in_epoch and list(s.current_file) != now:
            raise DataError(
                f"data.stream: partition {name} changed since the checkpoint stopped inside it after "
                f"{self._in_epoch} global batches: it held {s.current_file[0]} rows ({s.current_file[1]} bytes), "
                f"now {now[0]} rows ({now[1]} bytes); put its original file back and resume, or resume from a "
                "checkpoint saved before it (--resume CHECKPOINT_DIR); a landed partition must not change"
            )
        s.current_file = now

    def _score_partition(self) -> dict:
        """Progressive validation: the model's metrics on the partition before it trains on it."""
        s = self.stream
        if self._in_epoch == 0:  # its training batches' reader starts now: the first ones are read while it scores
            self._loaders.train.set_epoch(self.epoch)
            self._early_batches = self._loaders.train.iter_from(0)
        eval_bs = self.job.eval.batch_size or self.job.train.batch_size
        metrics = self.evaluate(
            self._loaders.train.reopen(shuffle=False, remainder="pad", scale_losses=False, batch_size=eval_bs)
        )
        managed = managed_metrics(self._model, "validation")
        self._writer.write(
            split="validation", step=self._step, epoch=s.index, partition=s.current, **metrics, **managed
        )
        s.validated = True
        maybe_fault("scored", self._step, self._ctx.rank)
        self._last_val = (self._step, metrics)
        for callback in self._callbacks:
            callback.on_validation_end(self, self._step, metrics)
        return metrics

    def _finish_partition(self) -> None:
        s, part = self.stream, self._partition
        name = s.current
        self._writer.write(
            split="partition",
            step=self._step,
            epoch=s.index,
            partition=name,
            rows=part.rows,
            skipped=part.skipped,
            steps=len(self._loaders.train) if self._loaders.train is not None else 0,
            seconds=round(time.perf_counter() - self._part_t0, 3),
            **_counter_change(s.counters_at_start, managed_counters(self._model)),
        )
        s.consumed.append(name)
        if part.skipped:
            s.skipped[name] = part.skipped
        s.current, s.validated, self._in_epoch, s.current_file = None, False, 0, None
        if self._ctx.is_main:
            self._idle_since = time.monotonic()
        if part.rows == 0:  # nothing trained: no new checkpoint (the state is kept beside this step's)
            self._record_between()
            checkpoint = None
        else:
            if self.job.checkpoint.enabled and self._saved_step != self._step:
                self._save_in_window()
            checkpoint = self._saved_path if self._saved_step == self._step else None
        entry = part.prepared.directory if part.prepared is not None else None
        if self._ctx.is_main and checkpoint is not None and entry is not None:  # recorded as trained: never read again
            shutil.rmtree(entry, ignore_errors=True)
            entry.with_name(f"{entry.name}.lock").unlink(missing_ok=True)
        for callback in self._callbacks:
            callback.on_partition_end(self, name, checkpoint)

    @contextmanager
    def _sigterm_stops(self):
        """SIGTERM sets a flag that :meth:`_should_stop` acts on (in the main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum, frame):
            self._signalled = signum

        old = signal.signal(signal.SIGTERM, note)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, old)


def _when(mtime_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime_ns / 1e9))


def _counter_change(before: dict, after: dict) -> dict:
    """``{"managed": {feature: {admitted, evicted, evicted_ttl, collided}}}``: what a partition
    added to each cumulative counter ({} without managed tables)."""
    if not after:
        return {}
    change = {f: {k: v - before.get(f, {}).get(k, 0) for k, v in c.items()} for f, c in after.items()}
    return {"managed": change}
