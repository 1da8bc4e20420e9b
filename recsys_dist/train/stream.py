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
from dataclasses import asdict, replace
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.dcp import latest_checkpoint
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.stream import (
    Partition,
    carries_histories,
    convert_partition,
    history_note,
    not_ready_reason,
    ready,
    scan,
)
from recsys_dist.distributed.env import broadcast_result
from recsys_dist.errors import DataError, FileChanging
from recsys_dist.faults import maybe_fault
from recsys_dist.section import ConfigError
from recsys_dist.train.build import Loaders, make_loaders
from recsys_dist.train.data_source import DataSource
from recsys_dist.train.job import Job
from recsys_dist.train.results import StreamSummary
from recsys_dist.train.stream_state import (
    HISTORIES_FILE,
    StreamState,
    histories_file,
    load_histories,
    open_window,
    record_between,
    restored_state,
    resume_window,
)
from recsys_dist.train.trainer import Trainer

log = logging.getLogger("recsys_dist")
STOP_CHECK_STEPS = 8  # a SIGTERM stops training within this many steps
PARTITIONS_DIR = "partitions"  # RUN_DIR/partitions: each partition's Parquet until it is trained
__all__ = ["StreamData", "StreamState", "StreamTrainer"]


class StreamData(DataSource):
    """The partitions of ``data.stream`` as they land: a :class:`StreamTrainer`'s data source.

    Attributes (besides a ``DataSource``'s):
        stream: the :class:`StreamState` (partitions consumed, quarantined, the current one).
    """

    def setup(self, checkpoint: Path | None) -> Job:
        t = self.trainer
        job = t.job
        if job.data.stream is None:
            raise ConfigError(
                "a StreamTrainer trains the partitions of data.stream as they land: set data.stream, or train "
                "data.raw_path with recsys_dist.Trainer"
            )
        path = str(Path(job.data.stream.path).resolve())
        self.stream = StreamState(global_batch=self.global_batch, path=path)
        self.loaders = Loaders(None, None, None, job.table_sizes)  # one partition's, once open
        self.total_steps = job.train.max_steps  # None: as long as data lands
        self._signalled: int | None = None
        self._stop_reason: str | None = None
        self._part_t0 = time.perf_counter()
        self._partition: Partition | None = None  # the partition open (its conversion)
        self._window: dict | None = None  # a logging window a stop leaves open, saved with the checkpoint
        self._noted: set[tuple[str, str]] = set()  # (what, name) said once in the log (rank 0)
        if t.ctx.is_main and (note := history_note(job.data)) is not None:
            log.warning(note)  # histories start afresh in each partition: said, not silent
        # data.stream.histories: carry: rank 0's (it converts) users' histories after the partitions
        # consumed, saved with each checkpoint; and after the partition open (taken at its end)
        self.histories: dict | None = {} if carries_histories(job.data) else None
        self._after: dict | None = None
        self._histories_file: tuple[dict, bytes] | None = None  # (the state, its histories.npz)
        return job

    def checkpoint_meta(self) -> dict:
        state = asdict(self.stream)
        state["batches"] = self.in_epoch if self.stream.current is not None else 0
        return {"stream": state, "window": self._window}

    def checkpoint_files(self) -> dict:
        """Under ``data.stream.histories: carry``, rank 0: ``histories.npz``, the users' histories
        after the partitions the checkpoint records as consumed."""
        if self.histories is None or not self.trainer.ctx.is_main:
            return {}
        # serialised once per state (it changes at a partition's end or a resume), not at every
        # checkpoint inside a partition: O(users x max_length) of Python each time
        if self._histories_file is None or self._histories_file[0] is not self.histories:
            self._histories_file = (
                self.histories,
                histories_file(self.histories, self.trainer.job.data.schema.history),
            )
        blob = self._histories_file[1]
        return {HISTORIES_FILE: lambda path: Path(path).write_bytes(blob)}

    def keeps_window(self) -> bool:
        # Stopped inside a partition: the window goes on after the resume, unless an uninterrupted
        # run closes it here too (the partition's end, a checkpoint by cadence).
        inside = self.in_epoch < len(self.loaders.train) and not self.trainer._checkpoint_due()
        return self._stop_reason == "SIGTERM" and inside

    def restore_position(self, path: Path, meta: dict) -> None:
        t = self.trainer
        state = restored_state(path, meta)  # a stream's checkpoint: run_dir.check_stream_resume
        if t.ctx.is_main and state.path is not None and state.path != self.stream.path:
            log.warning(
                "data.stream.path is %s; the checkpoint's run read %s. Partitions are named by their path below it: "
                "the %d name(s) trained there are not trained again here, whatever their content",
                self.stream.path,
                state.path,
                len(state.consumed),
            )
        state.global_batch, state.path = self.global_batch, self.stream.path
        self.stream = state
        if self.histories is not None:  # rank 0 reads them; its error, every rank's
            broadcast_result(t.ctx, lambda: setattr(self, "histories", load_histories(path, t.job.data.schema.history)))
        self.in_epoch = state.batches
        self.epoch = state.index
        if meta.get("window"):  # stopped inside a logging window: it goes on
            ctx, rec = t.ctx, t._recorder
            rec.losses, rec.real_rows, rec.window_seconds = resume_window(
                meta["window"], ctx.rank, ctx.world_size, ctx.device
            )
        log.info(
            "resumed from %s at step %d: %d partition(s) trained, %s",
            path,
            t.step,
            len(state.consumed),
            f"{state.current} at global batch {state.batches}" if state.current else "between partitions",
        )

    def stale_lines(self):
        t = self.trainer
        # config.yaml only once the resume (if any) was accepted: a refused one leaves the
        # config the checkpoints were trained with.
        broadcast_result(t.ctx, lambda: run_dirs.write_config(t.job.to_dict(), t.run_dir))
        # The checkpoint's own step may hold lines of what came after it (a partition scored or
        # quarantined after it was saved): written again, so dropped here.
        return lambda line: line.get("partition") is not None and not self.stream.accounts_for(line)

    def loader(self, split: str | ParquetBatchLoader) -> ParquetBatchLoader:
        """``split`` itself: a stream has no named splits (its partitions are scored as they land)."""
        if isinstance(split, ParquetBatchLoader):
            return split
        raise ValueError(
            f"a StreamTrainer has no {split!r} split to score: data.stream has no validation, test or train split "
            "(each partition is scored before the model trains on it: the 'validation' lines of metrics.jsonl "
            "naming it, and the summary's 'validation'). To score the model now (before fit(): the weights "
            "resumed from, or fresh ones; or after it), pass a loader of the rows: trainer.evaluate(loader) / "
            "trainer.predict(loader) with a recsys_dist.ParquetBatchLoader (docs/api.md), or export the run and "
            "use recsys-dist predict"
        )

    def should_stop(self, step: int) -> bool:
        """After a training step: every STOP_CHECK_STEPS steps (the same steps on every rank),
        whether to stop (:meth:`_agree_stop`): not every step, which would add a collective to
        each one."""
        return step % STOP_CHECK_STEPS == 0 and self._agree_stop()

    def _agree_stop(self) -> bool:
        """Every rank stops when any rank got SIGTERM (one all_reduce)."""
        t = self.trainer
        flag = torch.tensor([1 if self._signalled is not None else 0])
        if t.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) and self._stop_reason is None:
            self._stop_reason = "SIGTERM"
            log.warning("SIGTERM: stopping after step %d with a checkpoint", t.step)
        return bool(int(flag))

    # ------------------------------------------------------------------ the run

    def run(self) -> StreamSummary:
        """Train on the partitions of ``data.stream`` as they land, until it has been idle for
        ``stop_after_idle_seconds``, ``train.max_steps``, or SIGTERM; then save a checkpoint
        and write ``summary.json``. Collective.

        Returns:
            The summary (as :meth:`Trainer.fit`, ``test`` empty) with ``partitions`` (names
            trained), ``quarantined`` (name -> error), ``rows_skipped`` and ``skipped`` (bad rows
            left out under ``data.on_bad_row: skip``: the total, and name -> rows) and
            ``stopped`` (``idle``, ``max_steps`` or ``SIGTERM``).
        """
        t = self.trainer
        last_val: dict = {}
        self._idle_since = time.monotonic()
        # A later fit() of the same Trainer goes on with the partitions landed since: the last
        # one's stop (idle, a SIGTERM it acted on) ended that call only.
        self._stop_reason = self._signalled = None
        while not self.done(t.step) and self._stop_reason is None:
            name = self._next_partition()
            if name is None or not self._open(name):
                continue
            if t.job.data.stream.progressive_validation and not self.stream.validated:
                last_val = self._score_partition()
            with t.clock.phase("train"):
                t._train_steps(self.in_epoch)
            if self.in_epoch >= len(self.loaders.train):
                self._finish_partition()
        if self.done(t.step) and self._stop_reason is None:
            self._stop_reason = "max_steps"
        summary = self._summary(last_val)
        t._hooks.raise_failure(t)  # an on_step_end's at the run's last step: raised once it is saved
        return summary

    def _summary(self, last_val: dict) -> dict:
        t = self.trainer
        rec = t._recorder
        rec.tracer.close()
        rec.bar.close()
        c = t.job.checkpoint
        if rec.losses:  # a stop inside a partition: the checkpoint saves the open window
            seconds = time.perf_counter() - rec.t0
            self._window = open_window(rec.losses, rec.real_rows, seconds, t.ctx.world_size)
        path = None
        if c.enabled:
            path = t.save_checkpoint() if t._ckpt.saved_step != t.step else latest_checkpoint(t.run_dir)
        if self._window is not None:  # trained, though not logged yet: in the summary's numbers
            rec.rows_trained += sum(r["rows"] for r in self._window["ranks"])
            rec.train_seconds += self._window["seconds"]
            rec.losses, rec.real_rows, self._window = [], [], None
        s = self.stream
        return t._write_summary(
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
        t = self.trainer
        if self.stream.current is not None:
            return self.stream.current
        s = t.job.data.stream
        waiting = False
        while True:
            if self._agree_stop():
                return None
            kind, name = broadcast_result(t.ctx, self._look)
            if kind == "take":
                self.stream.quarantined.pop(name, None)  # a quarantined file that changed: tried again
                self.stream.current, self.stream.validated, self.in_epoch = name, False, 0
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
        t = self.trainer
        s, state = t.job.data.stream, self.stream
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
        t = self.trainer
        ctx, d, state = t.ctx, t.job.data, self.stream

        def convert():
            self._after = None
            try:
                part = convert_partition(d, name, t.run_dir / PARTITIONS_DIR, self.histories)
                self._after = part.histories  # kept on rank 0 until the partition is consumed; not sent
                return "ok", replace(part, histories=None)
            except FileChanging as err:
                return "changing", str(err)
            except DataError as err:
                return "bad", (str(err), getattr(err, "file_id", None))

        with t.clock.phase("data"):
            kind, value = broadcast_result(ctx, convert)
            if kind == "ok" and value.rows:  # opening the loaders counts as data, as in a batch run
                self.loaders = make_loaders(t.job.with_data(value.prepared), ctx)
            elif kind == "ok":
                self.loaders = Loaders(None, None, None, t.job.table_sizes)
        if kind == "changing":  # a writer is still at it: taken again once it stops changing
            self._note("changing", name, f"{value}; it is taken once it stops changing")
            if self.in_epoch == 0 and not state.validated:
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
        if self.in_epoch == 0:
            state.counters_at_start = t._task.managed_counters()
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
        t = self.trainer
        log.error("data.stream: partition %s is malformed and was quarantined (%s); training goes on", name, error)
        state = self.stream
        state.quarantined[name] = error
        if file_id is not None:
            state.files[name] = file_id
        t._recorder.write(split="quarantine", step=t.step, epoch=state.index, partition=name, error=error)
        self._record_between()

    def _record_between(self) -> None:
        """Keep the state (a quarantine, an empty partition: no training step) with the
        checkpoint of this step, so a resume does not read those partitions again: beside the
        one saved (or resumed from) at this step, else in a new one."""
        t = self.trainer
        if not t.job.checkpoint.enabled:
            return
        if t._ckpt.saved_step != t.step:
            latest = broadcast_result(t.ctx, lambda: latest_checkpoint(t.run_dir))
            if latest is None or run_dirs.checkpoint_step(latest) != t.step:
                t._save_in_window()
                return
            t._ckpt.saved_step, t._ckpt.saved_path = t.step, latest  # resumed from it, nothing trained since
        if t.ctx.is_main:
            record_between(t._ckpt.saved_path, t.step, self.stream)

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
        t = self.trainer
        if (what, name) in self._noted or not t.ctx.is_main:
            return
        self._noted.add((what, name))
        (log.warning if warn else log.info)(message)

    def _check_unchanged(self, name: str, now: list) -> None:
        """Refuse to go on inside partition ``name`` when its file changed since the checkpoint
        stopped in it (another row count or size: the batches done were of other rows)."""
        s = self.stream
        if s.current_file is not None and self.in_epoch and list(s.current_file) != now:
            raise DataError(
                f"data.stream: partition {name} changed since the checkpoint stopped inside it after "
                f"{self.in_epoch} global batches: it held {s.current_file[0]} rows ({s.current_file[1]} bytes), "
                f"now {now[0]} rows ({now[1]} bytes); put its original file back and resume, or resume from a "
                "checkpoint saved before it (--resume CHECKPOINT_DIR); a landed partition must not change"
            )
        s.current_file = now

    def _score_partition(self) -> dict:
        """Progressive validation: the model's metrics on the partition before it trains on it."""
        t = self.trainer
        s = self.stream
        if self.in_epoch == 0:  # its training batches' reader starts now: the first ones are read while it scores
            self.loaders.train.set_epoch(self.epoch)
            self.early_batches = self.loaders.train.iter_from(0)
        eval_bs = t.job.eval.batch_size or t.job.train.batch_size
        metrics = t.evaluate(
            self.loaders.train.reopen(shuffle=False, remainder="pad", scale_losses=False, batch_size=eval_bs)
        )
        managed = t._task.managed_metrics("validation")
        t._recorder.write(split="validation", step=t.step, epoch=s.index, partition=s.current, **metrics, **managed)
        s.validated = True
        maybe_fault("scored", t.step, t.ctx.rank)
        t._last_val = (t.step, metrics)
        t._hooks.validation_end(t, t.step, metrics)
        t._hooks.raise_failure(t)  # a callback raised: every rank raises (the last checkpoint holds the step)
        return metrics

    def _finish_partition(self) -> None:
        t = self.trainer
        s, part = self.stream, self._partition
        name = s.current
        t._recorder.write(
            split="partition",
            step=t.step,
            epoch=s.index,
            partition=name,
            rows=part.rows,
            skipped=part.skipped,
            steps=len(self.loaders.train) if self.loaders.train is not None else 0,
            seconds=round(time.perf_counter() - self._part_t0, 3),
            **_counter_change(s.counters_at_start, t._task.managed_counters()),
        )
        s.consumed.append(name)
        if self._after is not None:  # rank 0, carrying histories: the checkpoint below holds them
            self.histories, self._after = self._after, None
        if part.skipped:
            s.skipped[name] = part.skipped
        s.current, s.validated, self.in_epoch, s.current_file = None, False, 0, None
        if t.ctx.is_main:
            self._idle_since = time.monotonic()
        if part.rows == 0:  # nothing trained: no new checkpoint (the state is kept beside this step's)
            self._record_between()
            checkpoint = None
        else:
            if t.job.checkpoint.enabled and t._ckpt.saved_step != t.step:
                t._save_in_window()
            checkpoint = t._ckpt.saved_path if t._ckpt.saved_step == t.step else None
        entry = part.prepared.directory if part.prepared is not None else None
        if t.ctx.is_main and checkpoint is not None and entry is not None:  # recorded as trained: never read again
            shutil.rmtree(entry, ignore_errors=True)
            entry.with_name(f"{entry.name}.lock").unlink(missing_ok=True)
        t._hooks.partition_end(t, name, checkpoint)

    @contextmanager
    def stop_signals(self):
        """SIGTERM sets a flag that :meth:`should_stop` acts on (in the main thread only)."""
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


class StreamTrainer(Trainer):
    """A :class:`~recsys_dist.train.trainer.Trainer` over ``data.stream``: same arguments,
    same model, sharding, checkpoints and metrics; :meth:`fit` trains on partitions as they
    land (its data source is :class:`StreamData`) instead of epochs over ``data.raw_path``.
    ``recsys-dist train`` uses it when the config has ``data.stream``. Every rank builds one and
    calls :meth:`fit` (collective), which returns a ``StreamSummary`` (:meth:`StreamData.run`).

    Callbacks also get ``on_partition_end`` after each partition and ``on_resume`` after a
    resume, before training (``PublishCallback`` publishes the resumed checkpoint when a kill
    cut its publish short).

    ``evaluate`` / ``predict`` take a loader (``ParquetBatchLoader``) only, before or after
    :meth:`fit`: a stream has no ``"validation"`` / ``"test"`` / ``"train"`` split (each
    partition is scored as it lands, before training); a split name raises ``ValueError``
    saying so.

    Attributes (besides the Trainer's):
        stream: the :class:`StreamState` (partitions consumed, quarantined, the current one).

    Raises:
        ConfigError: as the Trainer; a resume mid-partition with another global batch; no ``data.stream``.
        CheckpointError: ``resume`` names a checkpoint of a run that was not a stream.
    """

    source_type = StreamData

    @property
    def stream(self) -> StreamState:
        return self._source.stream

    def fit(self) -> StreamSummary:
        """Train on the partitions of ``data.stream`` as they land (:meth:`StreamData.run`) until
        the stream is idle for ``stop_after_idle_seconds``, ``train.max_steps``, or SIGTERM; then
        save a checkpoint and write ``summary.json``. Collective.

        Called again on the same Trainer, it goes on where the last call stopped: it trains the
        partitions that landed since (the same run: ``metrics.jsonl`` continues, the summary
        counts every partition of the Trainer's life); at ``train.max_steps`` it trains nothing.

        Returns:
            the ``StreamSummary`` (``summary.json``).
        """
        return cast(StreamSummary, super().fit())


def _when(mtime_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime_ns / 1e9))


def _counter_change(before: dict, after: dict) -> dict:
    """``{"managed": {feature: {admitted, evicted, evicted_ttl, collided}}}``: what a partition
    added to each cumulative counter ({} without managed tables)."""
    if not after:
        return {}
    change = {f: {k: v - before.get(f, {}).get(k, 0) for k, v in c.items()} for f, c in after.items()}
    return {"managed": change}
