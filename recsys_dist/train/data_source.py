"""What a :class:`~recsys_dist.train.trainer.Trainer` trains on: its data source.

A source owns the loaders and the run's position in its data (the epoch or partition, the
batches of it done), and answers the Trainer's questions about them: where the next batches
come from (:meth:`DataSource.batches`), whether the run is done, what a checkpoint records of
the position and how a resume restores it, and which ``metrics.jsonl`` lines a resume writes
again. :meth:`DataSource.run` drives the Trainer's rounds (an epoch, or a partition).

- :class:`EpochData` (``data.raw_path``): epochs over the converted train / validation / test
  splits, validated at each epoch's end, the test split scored at the end.
- ``recsys_dist.train.stream.StreamData`` (``data.stream``): partitions as they land.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.meta import read_meta
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.distributed.env import broadcast_result
from recsys_dist.faults import maybe_fault
from recsys_dist.section import ConfigError
from recsys_dist.train.build import Loaders, keeps_best, make_loaders
from recsys_dist.train.evaluation import in_row_order
from recsys_dist.train.job import Job
from recsys_dist.train.summary import log_early_stop

# The Trainer a source works for (recsys_dist.train.trainer.Trainer; not imported: it imports this module)
Trainer = Any

log = logging.getLogger("recsys_dist")


class DataSource:
    """The data a Trainer trains on and its position in it (a base class: :class:`EpochData`,
    ``StreamData``). Built by the Trainer for itself; the Trainer sets it up once
    (:meth:`setup`) before the model is built.

    Attributes:
        loaders: this rank's loaders (``train``: of the current partition, a stream's).
        epoch: the epoch (a stream: the partition's ordinal) being, or last, trained.
        in_epoch: global batches of it trained.
        total_steps: steps the run trains in all (None: as long as data lands).
        global_batch: rows per global batch (``train.batch_size`` x ranks).
        data: the training split's identity (``meta.json`` ``data``), or None.
        step_offset: the step the current data's epochs count from (a resume on new data).
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.loaders: Loaders
        self.epoch = self.in_epoch = 0
        self.early_batches = None  # the next batches, opened while the model is scored
        self.total_steps: int | None = None
        self.global_batch = trainer.job.train.batch_size * trainer.ctx.world_size
        self.data: dict | None = None
        self.step_offset = 0

    def setup(self, checkpoint: Path | None) -> Job:
        """Open the data (``checkpoint``: the one the run resumes from, or None); returns the
        job to train (the data's sizes decided)."""
        raise NotImplementedError

    def run(self) -> dict:
        """Train every round (epoch / partition) and finish the run; returns its summary. Collective."""
        raise NotImplementedError

    def train_epoch(self) -> dict:
        raise TypeError(f"{type(self).__name__} has no epochs: fit() trains it")

    def done(self, step: int) -> bool:
        """Whether the run has trained all it will (at global ``step``)."""
        return self.total_steps is not None and step >= self.total_steps

    def nothing_left(self, step: int) -> bool:
        """Whether a resumed run at ``step`` has nothing to train (fit reports it, changing nothing)."""
        return False

    def should_stop(self, step: int) -> bool:
        """Whether every rank stops training now (a stream's SIGTERM); asked after each step."""
        return False

    def keeps_window(self) -> bool:
        """Whether a stop leaves the logging window open (a stream stopped inside a partition:
        the checkpoint saves the window, the resumed run continues it); else its line is written."""
        return False

    def checkpoint_meta(self) -> dict:
        """What a checkpoint's ``meta.json`` records of the position besides the epoch and batch."""
        return {}

    def checkpoint_files(self) -> dict:
        """Files a checkpoint holds besides its tensors and ``meta.json`` (rank 0's: name -> a
        function writing the file at the path it is given; a stream's carried histories)."""
        return {}

    def restore_position(self, path: Path, meta: dict) -> None:
        """Continue at the position checkpoint ``path`` (``meta``) recorded."""
        raise NotImplementedError

    def stale_lines(self):
        """A filter of the ``metrics.jsonl`` lines of the resumed step to write again, or None."""
        return None

    def stop_signals(self):
        """A context in which :meth:`should_stop` learns of stop signals (``fit`` runs in it)."""
        return nullcontext()

    def loader(self, split: str | ParquetBatchLoader) -> ParquetBatchLoader:
        """The loader of a split name (``train`` unshuffled, in row order), or ``split`` itself."""
        if isinstance(split, ParquetBatchLoader):
            return split
        if split in ("validation", "test"):
            return getattr(self.loaders, split)
        if split == "train":
            return in_row_order(self.loaders.train)
        raise ValueError(f"split must be 'train', 'validation', 'test' or a ParquetBatchLoader, got {split!r}")

    def validate(self) -> dict:
        """Score the held-out data now (``eval.every_n_steps``: an epoch run's)."""
        raise TypeError(f"{type(self).__name__} has no validation split")

    @property
    def steps_per_epoch(self) -> int | None:
        return len(self.loaders.train) if self.loaders.train is not None else None

    def batches(self, start: int):
        """The training batches of the current epoch / partition from its global batch ``start``
        (the ones opened early when ``start`` is 0)."""
        train = self.loaders.train
        train.set_epoch(self.epoch)
        self.in_epoch = start
        early, self.early_batches = self.early_batches, None
        return early if early is not None and start == 0 else train.iter_from(start)

    def open_early(self, epoch: int) -> None:
        """Start reading epoch ``epoch``'s first batches now (the loader's prefetch thread
        starts on opening), while the model is scored."""
        self.loaders.train.set_epoch(epoch)
        self.early_batches = self.loaders.train.iter_from(0)


class EpochData(DataSource):
    """Epochs over the converted splits of ``data.raw_path`` (``train.epochs``, capped by
    ``train.max_steps``, stopped early by ``train.early_stopping``).

    Attributes (besides a :class:`DataSource`'s):
        next_epoch: the epoch :meth:`train_epoch` trains next.
    """

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.resume_on_new_data = trainer._resume_on_new_data
        self.next_epoch = self.first_epoch = 0
        self.in_run = False  # inside run(): fit()
        self.new_data, self.resume_epoch = False, 0

    def setup(self, checkpoint: Path | None) -> Job:
        """The loaders, the training data's identity and where the run starts and ends."""
        t = self.trainer
        job, ctx = t.job, t.ctx
        if job.data.stream is not None:
            raise ConfigError(
                "data.stream: a run over landing partitions is a recsys_dist.StreamTrainer (recsys-dist train "
                "picks it); the Trainer trains epochs over data.raw_path"
            )
        with t.clock.phase("data"):
            self.loaders = make_loaders(job, ctx)  # converts the data; decides the table sizes
        # The training split's identity, recorded in each checkpoint; a resume on another one
        # is refused unless resume_on_new_data (then its epoch starts again: resume_position).
        conversion = self.loaders.conversion
        self.data = broadcast_result(
            ctx, lambda: run_dirs.data_identity(conversion, job.data.raw_path) if conversion is not None else None
        )
        meta = read_meta(checkpoint) if checkpoint is not None else None
        flag = "resume_on_new_data=True (on the command line --resume-on-new-data)"
        self.new_data = meta is not None and run_dirs.check_same_data(
            checkpoint, meta, self.data, self.resume_on_new_data, flag
        )
        per_epoch = len(self.loaders.train)
        # a checkpoint's position is in its own global batch
        if meta is not None:
            self.resume_epoch, self.step_offset = run_dirs.resume_position(
                meta, per_epoch, self.new_data, self.global_batch
            )
        self.total_steps = job.train.total_steps(per_epoch, self.step_offset)
        # A resumed run replaces config.yaml only when there is something left to train.
        done = checkpoint is not None and run_dirs.checkpoint_step(checkpoint) >= self.total_steps
        broadcast_result(ctx, lambda: run_dirs.write_config(job.to_dict(), t.run_dir, write=not done))
        log.info(
            "data ready: %d train / %d validation / %d test rows, %d steps per epoch",
            self.loaders.train.num_rows,
            self.loaders.validation.num_rows,
            self.loaders.test.num_rows,
            len(self.loaders.train),
        )
        return self.loaders.job  # the job with the table sizes the conversion decided (made once)

    def done(self, step: int) -> bool:
        best = self.trainer.best
        return step >= self.total_steps or (best is not None and best.stopped)

    def nothing_left(self, step: int) -> bool:
        return self.done(step)

    def restore_position(self, path: Path, meta: dict) -> None:
        """Where the resumed run continues: the checkpoint's epoch and batch."""
        self.next_epoch, self.in_epoch = run_dirs.resume_batch(meta, self.global_batch)
        if self.new_data:
            log.warning(
                "resuming %s on other training data (%s, was %s): epoch %d starts again from its first batch",
                path,
                self.data,
                meta.get("data"),
                self.resume_epoch,
            )
            self.next_epoch, self.in_epoch = self.resume_epoch, 0
        if self.in_epoch >= len(self.loaders.train):
            self.next_epoch, self.in_epoch = self.next_epoch + 1, 0
        self.epoch = self.first_epoch = self.next_epoch
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)", path, self.trainer.step, self.next_epoch, self.in_epoch
        )

    def run(self) -> dict:
        """Every epoch left, then the best weights back (``restore_best``), the test split,
        the final checkpoint and ``summary.json``."""
        t = self.trainer
        last_val: dict = {}
        self.in_run = True
        try:
            while self.next_epoch < t.job.train.epochs and not self.done(t.step):
                last_val = t.train_epoch() or last_val
            return self.finish(last_val)
        finally:
            self.in_run = False

    def train_epoch(self) -> dict:
        """Train epoch ``next_epoch`` (from the checkpoint's batch after a resume), then score
        the validation split; checkpoint by cadence."""
        t = self.trainer
        self.epoch = self.next_epoch
        # The first epoch after a resume continues at the checkpoint's batch; later ones start at 0.
        t._train_steps(self.in_epoch if self.epoch == self.first_epoch else 0)
        if self.epoch + 1 < t.job.train.epochs and not self.done(t.step):
            # The next epoch's first window (40-150 ms) is read while this epoch's validation runs.
            self.open_early(self.epoch + 1)
        metrics = self.validate()
        # After the validation, so that a run resumed from it (which starts the next epoch)
        # keeps the epoch's validation line and early-stopping state.
        if t._checkpoint_due():
            t._save_in_window()
        self.next_epoch += 1
        if not (self.in_run and self.done(t.step)):  # fit's last validation: raised after finish()
            t._hooks.raise_failure(t)
        return metrics

    def validate(self) -> dict:
        """Score the validation split once per step (a step both an epoch's end and a multiple
        of eval.every_n_steps is scored once), log it, update the best / early stopping and keep
        a new best: a checkpoint (``build.keeps_best``), or a copy in memory (restore_best with
        checkpoints off)."""
        t = self.trainer
        if t._last_val is not None and t._last_val[0] == t.step:
            return t._last_val[1]
        maybe_fault("eval", t.step, t.ctx.rank)
        metrics = t.evaluate("validation")
        t._last_val = (t.step, metrics)
        managed = t._task.managed_metrics("validation")
        t._recorder.write(split="validation", step=t.step, epoch=self.epoch, **metrics, **managed)
        t._hooks.validation_end(t, t.step, metrics)  # each a copy; an exception held, raised once saved
        if metrics.get("auc") is not None:
            t._recorder.bar.set_postfix_str(f"val AUC {metrics['auc']:.4f}", refresh=False)
        if t.best is not None:
            improved = t.best.update(metrics, t.step)
            if t.best.stopped:
                log_early_stop(t.best, t.step)
            if improved and keeps_best(t.job):
                t._save_in_window(best=True)
            elif improved:
                t._ckpt.keep_best(t.step)
        return metrics

    def finish(self, last_val: dict) -> dict:
        """The end of an epoch run: the best weights back (``restore_best``), the test split
        scored and logged, the final checkpoint and ``summary.json``."""
        t = self.trainer
        t._recorder.tracer.close()
        t._recorder.bar.close()
        weights_step, last_val = self._restore_best(last_val)  # train.early_stopping.restore_best
        test = t.evaluate("test")
        managed = t._task.managed_metrics("test")
        # step: the training position; weights_step: whose weights were scored (restore_best).
        t._recorder.write(split="test", step=t.step, weights_step=weights_step, epoch=self.epoch, **test, **managed)
        checkpoint = t.save_checkpoint() if t.job.checkpoint.enabled else None
        summary = t._write_summary(last_val, test, checkpoint, weights_step)
        t._hooks.raise_failure(t)  # a callback raised at the last validation: raised now, the run finished
        return summary

    def _restore_best(self, last_val: dict) -> tuple[int, dict]:
        """At the end of training with ``train.early_stopping.restore_best``: put back the
        weights (and optimizer state) of the best validation (``Checkpointer.restore_best``).
        Collective.

        Returns:
            The step whose weights the model now holds, and their validation metrics
            (``last_val`` when the last weights are kept)."""
        t = self.trainer
        es, b = t.job.train.early_stopping, t.best
        if es is None or not es.restore_best or b is None or b.best_step is None or b.best_step == t.step:
            return t.step, last_val
        if not t._ckpt.restore_best(b, t.step, t.resumed_from):
            return t.step, last_val
        # Their validation metrics, as scored at that step (a checkpoint of an older recsys_dist
        # recorded none: scored again).
        return b.best_step, b.best_metrics or t.evaluate("validation")
