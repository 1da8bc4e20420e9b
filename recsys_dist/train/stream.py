"""Online training: a :class:`StreamTrainer` trains on partitions as they land (``data.stream``).

The run waits for files under ``data.stream.path`` (``recsys_dist.data.stream``) and takes
them one at a time, in name order. For each partition: rank 0 converts it (a malformed one is
quarantined: named in the log and in ``metrics.jsonl``, and training goes on), every rank
opens its share, the model scores it before training on it (progressive validation: a
``validation`` line naming the partition), trains on every row once, writes a ``partition``
line (rows, steps, seconds, the managed-collision counters of that partition) and saves a
checkpoint. It stops after ``stop_after_idle_seconds`` without a new partition, at
``train.max_steps``, or on SIGTERM (after a checkpoint, exit 0); else it waits forever.

Exactly once: a checkpoint records the partitions consumed, the partition being trained and
the global batches of it done (``meta.json`` ``stream``), so a resume (``--resume auto``
after a kill anywhere) neither skips nor repeats a row; ``metrics.jsonl`` lines after the
checkpoint's step, and lines of its own step that it does not account for (a partition
scored after it was saved), are written again. The global batch (``train.batch_size`` x
ranks) may change only at a partition boundary: the order of a partition's rows is that of
its global batches (docs/online.md).
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.dcp import latest_checkpoint
from recsys_dist.data.convert import PreparedData
from recsys_dist.data.stream import convert_partition, landed
from recsys_dist.distributed.env import broadcast_result
from recsys_dist.errors import DataError
from recsys_dist.faults import maybe_fault
from recsys_dist.models.managed import managed_counters, managed_metrics
from recsys_dist.train.build import Loaders, make_loaders
from recsys_dist.train.results import StreamSummary
from recsys_dist.train.trainer import Trainer

log = logging.getLogger("recsys_dist")
STOP_CHECK_STEPS = 8  # a SIGTERM stops training within this many steps
PARTITIONS_DIR = "partitions"  # RUN_DIR/partitions: each partition's Parquet until it is trained


@dataclass
class StreamState:
    """Where a stream run is (``meta.json`` ``stream`` of each checkpoint).

    Attributes:
        consumed: partitions trained to their end, in the order taken.
        quarantined: malformed partitions -> their error.
        current: the partition being scored / trained, or None between partitions.
        validated: ``current`` has been scored (its progressive-validation line written).
        batches: global batches of ``current`` trained.
        global_batch: rows per global batch the batches count.
        counters_at_start: the managed-collision counters when ``current`` started.
        current_file: ``current``'s [rows, bytes] when it was opened (a resume inside it checks them).
        path: ``data.stream.path`` (absolute) the names are below.
    """

    consumed: list[str] = field(default_factory=list)
    quarantined: dict[str, str] = field(default_factory=dict)
    current: str | None = None
    validated: bool = False
    batches: int = 0
    global_batch: int = 0
    counters_at_start: dict = field(default_factory=dict)
    current_file: list | None = None
    path: str | None = None

    @property
    def index(self) -> int:
        """The ordinal of ``current`` among the partitions trained (its ``epoch`` in metrics)."""
        return len(self.consumed)

    def seen(self, name: str) -> bool:
        return name in self.quarantined or name in self.consumed

    def accounts_for(self, line: dict) -> bool:
        """Whether a ``metrics.jsonl`` line naming a partition is this state's doing."""
        name, split = line.get("partition"), line.get("split")
        if split == "validation":
            return name in self.consumed or (name == self.current and self.validated)
        if split == "quarantine":
            return name in self.quarantined
        return name in self.consumed


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
        cfg, ctx = self.cfg, self._ctx
        path = str(Path(cfg.data.stream.path).resolve())
        self.stream = StreamState(global_batch=cfg.train.batch_size * ctx.world_size, path=path)
        self._loaders = Loaders(None, None, None, self._job.table_sizes)  # one partition's, once open
        self._data, self._new_data = None, False
        self._global_batch = self.stream.global_batch
        self._resume_epoch = self._step_offset = 0
        self.total_steps = cfg.train.max_steps  # None: as long as data lands
        self._signalled: int | None = None
        self._stop_reason: str | None = None
        self._part_t0 = time.perf_counter()

    def _done(self) -> bool:
        return self.total_steps is not None and self._step >= self.total_steps

    def _checkpoint_meta(self) -> dict:
        state = asdict(self.stream)
        state["batches"] = self._in_epoch if self.stream.current is not None else 0
        return {**super()._checkpoint_meta(), "stream": state}

    def _restore_position(self, path: Path, meta: dict) -> None:
        state = StreamState(**meta["stream"])  # a stream's checkpoint: run_dir.check_stream_resume
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
        broadcast_result(self._ctx, lambda: run_dirs.write_config(self.cfg, self.run_dir))
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
            trained), ``quarantined`` (name -> error) and ``stopped`` (``idle``, ``max_steps``
            or ``SIGTERM``).
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
                if self.cfg.data.stream.progressive_validation and not self.stream.validated:
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
        c = self.cfg.checkpoint
        path = None
        if c.enabled:
            path = self.save_checkpoint() if self._saved_step != self._step else latest_checkpoint(self.run_dir)
        s = self.stream
        return self._write_summary(
            last_val, {}, path, partitions=list(s.consumed), quarantined=dict(s.quarantined), stopped=self._stop_reason
        )

    def _next_partition(self) -> str | None:
        """The partition to train next (the one a checkpoint stopped in, else the first new one
        in name order), waiting ``poll_seconds`` between looks; None to stop (idle, SIGTERM)."""
        if self.stream.current is not None:
            return self.stream.current
        s = self.cfg.data.stream
        waiting = False
        while True:
            if self._agree_stop():
                return None
            kind, name = broadcast_result(self._ctx, self._look)
            if kind == "take":
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
        """Rank 0: ("take", name), ("idle", None) past stop_after_idle_seconds, or ("wait", None)."""
        s = self.cfg.data.stream
        new = [n for n in landed(s) if not self.stream.seen(n)]
        if new:
            last = self.stream.consumed[-1] if self.stream.consumed else None
            if last is not None and new[0] < last:
                log.warning("data.stream: partition %s landed after %s was trained; training it now", new[0], last)
            return "take", new[0]
        idle = s.stop_after_idle_seconds
        if idle is not None and time.monotonic() - self._idle_since >= idle:
            return "idle", None
        return "wait", None

    def _open(self, name: str) -> bool:
        """Convert ``name`` (rank 0) and open every rank's loaders of it; False when it was
        quarantined or empty (then the stream moves on)."""
        ctx, d = self._ctx, self.cfg.data

        def convert():
            path = Path(d.stream.path) / name
            if path.is_file() and path.stat().st_size == 0:  # the conversion would refuse it as malformed
                return "ok", (PreparedData(None, {}, {"train": 0}), [0, 0])  # no directory: nothing to remove
            try:
                prepared = convert_partition(d, name, self.run_dir / PARTITIONS_DIR)
                return "ok", (prepared, [int(prepared.rows["train"]), (Path(d.stream.path) / name).stat().st_size])
            except DataError as err:
                return "bad", str(err)

        with self._clock.phase("data"):
            kind, value = broadcast_result(ctx, convert)
            if kind == "ok":  # opening the loaders counts as data, as in a batch run
                empty = Loaders(None, None, None, self._job.table_sizes)  # a 0-byte partition
                self._loaders = make_loaders(self._job.with_data(value[0]), ctx) if value[1][0] else empty
        if kind == "bad":
            log.error("data.stream: partition %s is malformed and was quarantined (%s); training goes on", name, value)
            self.stream.quarantined[name] = value
            self.stream.current = None
            self._writer.write(
                split="quarantine", step=self._step, epoch=self.stream.index, partition=name, error=value
            )
            return False
        self._prepared, identity = value
        self._check_unchanged(name, identity)
        self._part_t0 = time.perf_counter()
        if self._in_epoch == 0:
            self.stream.counters_at_start = managed_counters(self._model)
        if self._prepared.rows["train"] == 0:
            log.warning("data.stream: partition %s holds no rows", name)
            self._finish_partition()
            return False
        self.epoch = self.stream.index
        return True

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
        eval_bs = self.cfg.eval.batch_size or self.cfg.train.batch_size
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
        s = self.stream
        name = s.current
        self._writer.write(
            split="partition",
            step=self._step,
            epoch=s.index,
            partition=name,
            rows=int(self._prepared.rows["train"]),
            steps=len(self._loaders.train) if self._loaders.train is not None else 0,
            seconds=round(time.perf_counter() - self._part_t0, 3),
            **_counter_change(s.counters_at_start, managed_counters(self._model)),
        )
        s.consumed.append(name)
        s.current, s.validated, self._in_epoch, s.current_file = None, False, 0, None
        if self._ctx.is_main:
            self._idle_since = time.monotonic()
        if self.cfg.checkpoint.enabled and self._saved_step != self._step:
            self._save_in_window()
        checkpoint = self._saved_path if self._saved_step == self._step else None
        entry = self._prepared.directory  # (and its lock file: this run's directory is its own)
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


def _counter_change(before: dict, after: dict) -> dict:
    """``{"managed": {feature: {admitted, evicted, evicted_ttl, collided}}}``: what a partition
    added to each cumulative counter ({} without managed tables)."""
    if not after:
        return {}
    change = {f: {k: v - before.get(f, {}).get(k, 0) for k, v in c.items()} for f, c in after.items()}
    return {"managed": change}
