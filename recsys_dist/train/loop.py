"""The Trainer's step loop: epochs of pipelined steps, validation and early stopping, the
training log, and saving / restoring its state in checkpoints.

:class:`TrainLoop` holds these internals of :class:`recsys_dist.train.trainer.Trainer`, which
builds the state they use (``_setup``) and calls them from its public methods.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.compat import check_compatible
from recsys_dist.checkpoint.dcp import (
    canonical_optimizer_state,
    latest_checkpoint,
    load_checkpoint,
    set_optimizer_steps,
)
from recsys_dist.checkpoint.meta import read_meta
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.record import MANIFEST_FILE, Preprocessing
from recsys_dist.distributed.env import broadcast_result
from recsys_dist.distributed.optim import init_lazy_state
from recsys_dist.distributed.plan_io import plan_summary
from recsys_dist.faults import maybe_fault
from recsys_dist.files import write_atomic
from recsys_dist.models.managed import managed_metrics
from recsys_dist.train.best_weights import checkpoint_of_step
from recsys_dist.train.build import keeps_best
from recsys_dist.train.evaluation import in_row_order
from recsys_dist.train.pipelines import PIPELINES, TrainPipeline, make_pipeline
from recsys_dist.train.summary import divergence_error, log_early_stop, run_summary, train_window

log = logging.getLogger("recsys_dist")


class TrainLoop:
    """The loop and checkpoint internals of a Trainer (a base class of it; not used alone)."""

    @contextmanager
    def _collective(self):
        if self._closed:
            raise RuntimeError("this Trainer is closed")
        if not dist.is_initialized() or dist.group.WORLD is not self._group:
            # Its owner (the Trainer that made it, closed first, or the caller) destroyed it;
            # torch would only say that no default process group exists.
            raise RuntimeError(
                "the process group this Trainer was built on has been destroyed (by closing the "
                "Trainer that created it, or by torch.distributed.destroy_process_group()); close "
                "this Trainer and build a new one, or close Trainers in the reverse order of creation"
            )
        try:
            yield
        except BaseException:
            self._failed = True
            raise

    def _take_run_dir(self) -> None:
        """Rank 0 holds the run directory's lock until :meth:`close` (unless the launcher that
        started this process holds it); every rank raises if another run holds it."""
        # An elastic restart's new rank 0 may start while the previous one is still exiting.
        wait = 30.0 if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 else 0.0

        def take() -> None:
            self._lock = run_dirs.lock_run_dir(self.run_dir, wait_s=wait)

        broadcast_result(self._ctx, take)

    def _loader(self, split: str | ParquetBatchLoader) -> ParquetBatchLoader:
        if isinstance(split, ParquetBatchLoader):
            return split
        if split in ("validation", "test"):
            return getattr(self._loaders, split)
        if split == "train":
            return in_row_order(self._loaders.train)
        raise ValueError(f"split must be 'train', 'validation', 'test' or a ParquetBatchLoader, got {split!r}")

    def _done(self) -> bool:
        return self._step >= self.total_steps or (self.best is not None and self.best.stopped)

    def _checkpoint_meta(self) -> dict:
        """What a checkpoint's meta.json records besides its tensors: position, plan, config, data."""
        meta = {
            "step": self._step,
            "epoch": self.epoch,
            "batches_in_epoch": self._in_epoch,
            "rows_trained": self.rows_trained,
            "train_seconds": self.train_seconds,
            "world_size": self._ctx.world_size,
            "plan": plan_summary(self._model.plan),
            "config": self.job.to_dict(),
            "num_embeddings": self._loaders.num_embeddings,
            "early_stopping": self.best.state() if self.best is not None else None,
            # Not the step's own after restore_best put back the best validation's weights.
            "weights_step": self._step if self._weights_step is None else self._weights_step,
            # The training data (recsys_dist.checkpoint.run_dir.check_same_data) and where its epochs start.
            "data": self._data,
            "steps_per_epoch": len(self._loaders.train) if self._loaders.train is not None else None,
            "step_offset": self._step_offset,
        }
        if self._user_model is not None:  # config.model names no model: export/load_model refuse it
            meta["user_model"] = True
        return meta

    def _pin_preprocessing(self, path: Path) -> None:
        # How inputs are mapped (vocabulary, sizes, transforms) travels with the checkpoint,
        # so export and predict never read the training data again (recsys_dist.data.record).
        conversion = self._loaders.conversion
        manifest = json.loads((conversion / MANIFEST_FILE).read_text()) if conversion is not None else None
        try:
            Preprocessing.describe(
                self.job.data, self.job.fmt, self._loaders.num_embeddings, conversion, manifest
            ).save(path)
        except OSError as err:  # the checkpoint is complete without it; scoring falls back to the cache
            log.warning("could not write the preprocessing record into %s (%s)", path, err)

    def _state(self) -> dict:
        return {
            "model": self._model.state_dict(),
            "optimizer": canonical_optimizer_state(self._optimizer.state_dict()),
            # One per rank: the ranks draw different dropout masks (a single "rng" entry would be
            # saved once, by one rank, and handed to every rank on resume).
            "rng": {f"rank_{self._ctx.rank}": torch.get_rng_state()},
        }

    def _restore(self, path: Path) -> None:
        """Continue from a checkpoint: weights, optimizer state, RNG and the loader position."""
        meta = read_meta(path)
        run_dirs.check_stream_resume(path, meta, self.job.data.stream is not None, self._global_batch)
        check_compatible(
            path,
            meta,
            self.job.to_dict(),
            sizes=self._loaders.num_embeddings,
            world_size=self._ctx.world_size,
            user_model=self._user_model is not None,
        )
        init_lazy_state(self._optimizer, self._model.fused_optimizer)
        state = self._state()
        if meta.get("world_size") != self._ctx.world_size:  # no rank's random stream continues
            del state["rng"]
        load_checkpoint(path, state, verify=False)  # verified in _setup; in place: the state dicts are views
        set_optimizer_steps(self._optimizer, meta["step"])
        if "rng" in state:
            torch.set_rng_state(state["rng"][f"rank_{self._ctx.rank}"])
        self._step, self.rows_trained = meta["step"], meta["rows_trained"]
        self.train_seconds = meta["train_seconds"]
        if self.best is not None:
            self.best.load(meta.get("early_stopping"))
        if meta.get("weights_step", self._step) != self._step and not self._done() and self._ctx.is_main:
            log.warning(
                "checkpoint %s holds the weights of step %d, the best validation's (train.early_stopping."
                "restore_best), at step %d's data position: training on continues from those weights",
                path,
                meta["weights_step"],
                self._step,
            )
        self._restore_position(path, meta)
        self._bar.update(self._step)

    def _restore_position(self, path: Path, meta: dict) -> None:
        """Where the resumed run continues: the checkpoint's epoch and batch."""
        self._next_epoch, self._in_epoch = run_dirs.resume_batch(meta, self._global_batch)
        if self._new_data:
            log.warning(
                "resuming %s on other training data (%s, was %s): epoch %d starts again from its first batch",
                path,
                self._data,
                meta.get("data"),
                self._resume_epoch,
            )
            self._next_epoch, self._in_epoch = self._resume_epoch, 0
        if self._in_epoch >= len(self._loaders.train):
            self._next_epoch, self._in_epoch = self._next_epoch + 1, 0
        self.epoch = self._first_epoch = self._next_epoch
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, self._step, self._next_epoch, self._in_epoch)

    def _replay_lr_scheduler(self) -> None:
        """Bring a user LR scheduler to the resumed step (its state follows from the step count)."""
        if self._lr_scheduler is None:
            return
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(self._step):
                self._lr_scheduler.step()

    def _run_epoch(self) -> dict:
        job = self.job
        # The first epoch after a resume continues at the checkpoint's batch; later ones start at 0.
        self._train_steps(self._in_epoch if self.epoch == self._first_epoch else 0)
        if self.epoch + 1 < job.train.epochs and not self._done():
            # The loader's prefetch thread starts on opening: the next epoch's first window
            # (40-150 ms) is read while this epoch's validation runs.
            self._loaders.train.set_epoch(self.epoch + 1)
            self._early_batches = self._loaders.train.iter_from(0)
        metrics = self._validate()
        # After the validation, so that a run resumed from it (which starts the next epoch)
        # keeps the epoch's validation line and early-stopping state.
        if self._checkpoint_due():
            self._save_in_window()
        return metrics

    def _should_stop(self) -> bool:
        """Whether every rank stops training now (a stream's SIGTERM); checked after each step."""
        return False

    def _keeps_window(self) -> bool:
        """Whether a stop leaves the logging window open (a stream stopped inside a partition:
        the checkpoint saves the window, the resumed run continues it); else its line is written."""
        return False

    def _train_steps(self, start: int) -> None:
        """Train ``self._loaders.train`` (epoch ``self.epoch``) from its batch ``start`` to its
        end, ``total_steps`` or a stop; checkpoints by cadence on the way."""
        job, ctx = self.job, self._ctx
        pipe = self._pipe = self._next_pipeline()
        self._pipe_drained = False
        self._weights_step = None  # trained on: the weights are the step's own again
        self._loaders.train.set_epoch(self.epoch)
        self._in_epoch = start
        early, self._early_batches = self._early_batches, None
        batches = early if early is not None and start == 0 else self._loaders.train.iter_from(start)
        # A window a checkpoint carried over (a stream stopped inside it) counts its seconds too.
        self._t0, self._window_seconds = time.perf_counter() - self._window_seconds, 0.0
        while not self._done():
            self._tracer.before(self._step + 1)
            try:
                if self._schedule.active:
                    self._schedule.apply(self._optimizer, self._base_lrs, self._step)
                    # FBGEMM takes a new rate at its optimizer's step(), which only sets the
                    # rate; calling it now makes this step's fused update use it.
                    self._model.fused_optimizer.step()
                out = pipe.progress(batches)
            except StopIteration:
                self._pipe_drained = True  # nothing in flight: the next epoch / partition may reuse it
                break
            self._step += 1
            self._in_epoch += 1
            maybe_fault("step", self._step, ctx.rank)
            self._tracer.after(self._step)
            self._losses.append(out[0].detach())
            if self._lr_scheduler is not None:
                self._lr_scheduler.step()
            for callback in self._callbacks:
                callback.on_step_end(self, self._step, out[0].detach())
            self._real_rows.append(out[3])  # the weights [B]; summed once per log line, not per step
            self._bar.update(1)
            if self._step % job.train.log_every_n_steps == 0:
                self._log_train()
            if self._should_stop():
                break
            if self._in_epoch >= len(self._loaders.train) or self._done():
                # The epoch's (or run's) last step: validated, then checkpointed, after the loop.
                continue
            if job.eval.every_n_steps and self._step % job.eval.every_n_steps == 0:
                self._validate()  # detaches the pipeline (evaluate); its next progress re-attaches
                if self._done():  # early stopping: every rank decides alike (global metrics)
                    break
                self._t0 = time.perf_counter()
            if self._checkpoint_due():
                self._save_in_window()
            if self._saved_step == self._step and PIPELINES[job.train.pipeline].restart_at_checkpoint:
                # A checkpoint (by cadence or a new best) mid-epoch: see recsys_dist.train.pipelines.
                pipe.detach()
                pipe = self._pipe = self._new_pipeline()
                batches = self._loaders.train.iter_from(self._in_epoch)
                self._t0 = time.perf_counter()
        if self._losses and not self._keeps_window():
            self._log_train()
        pipe.detach()

    def _checkpoint_due(self) -> bool:
        every = self.job.checkpoint.every_n_steps
        return (
            self.job.checkpoint.enabled
            and bool(every)
            and self._step % every == 0
            and not self._done()
            and self._saved_step != self._step
        )

    def _save_in_window(self, best: bool = False) -> None:
        if self._losses:  # close the logging window here, so a resumed run logs the same lines
            self._log_train()
        self.save_checkpoint(best=best)
        self._t0 = time.perf_counter()

    def _detach_pipeline(self) -> None:
        # Scoring needs the plain forward; inside the loop (a validation, or a callback's
        # evaluate / predict) the pipeline has rewritten it. Its next progress re-attaches.
        if self._pipe is not None:
            self._pipe.detach()

    def _next_pipeline(self) -> TrainPipeline:
        """The pipeline of the next epoch (or stream partition): the last one when it ran its
        iterator dry (no batch in flight; reset for a new iterator), so that its set-up (the
        model's trace) is paid once per run, not per partition; else a new one."""
        pipe = self._pipe
        if pipe is None or not self._pipe_drained or not PIPELINES[self.job.train.pipeline].reusable:
            return self._new_pipeline()
        pipe.reset()
        pipe.steps_done = self._step
        return pipe

    def _new_pipeline(self) -> TrainPipeline:
        # Sampling counts global steps, so timed steps do not restart with each epoch.
        t = self.job.train
        pipe = make_pipeline(t.pipeline, self._model, self._optimizer, self._ctx.device, t.timing_every_n_steps)
        pipe.steps_done = self._step
        return pipe

    def _validate(self) -> dict:
        """Score the validation split once per step (a step both an epoch's end and a multiple
        of eval.every_n_steps is scored once), log it, update the best / early stopping and keep
        a new best: a checkpoint (``build.keeps_best``), or a copy in memory (restore_best with
        checkpoints off)."""
        if self._last_val is not None and self._last_val[0] == self._step:
            return self._last_val[1]
        maybe_fault("eval", self._step, self._ctx.rank)
        metrics = self.evaluate("validation")
        self._last_val = (self._step, metrics)
        for callback in self._callbacks:
            callback.on_validation_end(self, self._step, metrics)
        managed = managed_metrics(self._model, "validation")
        self._writer.write(split="validation", step=self._step, epoch=self.epoch, **metrics, **managed)
        if metrics.get("auc") is not None:
            self._bar.set_postfix_str(f"val AUC {metrics['auc']:.4f}", refresh=False)
        if self.best is not None:
            improved = self.best.update(metrics, self._step)
            if self.best.stopped:
                log_early_stop(self.best, self._step)
            if improved and keeps_best(self.job):
                self._save_in_window(best=True)
            elif improved and self._memory_best is not None:
                self._memory_best.keep(self._model, self._step)
        return metrics

    def _restore_best(self, last_val: dict) -> tuple[int, dict]:
        """At the end of training with ``train.early_stopping.restore_best``: put back the
        weights (and optimizer state) of the best validation, read from its checkpoint (or, with
        checkpoints off, from the copy in memory). Collective.

        Returns:
            The step whose weights the model now holds, and their validation metrics
            (``last_val`` when the last weights are kept)."""
        es = self.job.train.early_stopping
        b = self.best
        if es is None or not es.restore_best or b is None or b.best_step is None or b.best_step == self._step:
            return self._step, last_val
        if self._memory_best is not None and self._memory_best.step == b.best_step:
            self._memory_best.restore(self._model)
            source = "memory"
        else:
            # The run's own, or (resumed from another run's checkpoint) that run's.
            roots = [self.run_dir / "checkpoints"] + ([self.resumed_from.parent] if self.resumed_from else [])
            path = broadcast_result(self._ctx, lambda: checkpoint_of_step(roots, b.best_step))
            if path is None:
                log.warning(
                    "train.early_stopping.restore_best: the checkpoint of the best validation (step %d) is in none "
                    "of %s (deleted?); the test split is scored and the final checkpoint saved with the last "
                    "weights (step %d)",
                    b.best_step,
                    ", ".join(map(str, roots)),
                    self._step,
                )
                return self._step, last_val
            with self._clock.phase("checkpoint"):
                init_lazy_state(self._optimizer, self._model.fused_optimizer)
                state = self._state()
                del state["rng"]  # the random streams go on from the last step
                load_checkpoint(path, state)  # verified (checksums) by rank 0 first
                source = str(path)
        self._weights_step = b.best_step
        log.info(
            "restored the weights of step %d (best validation %s %.6g) from %s; trained to step %d",
            b.best_step,
            b.metric,
            b.best,
            source,
            self._step,
        )
        # Their validation metrics, as scored at that step (a checkpoint of an older recsys_dist
        # recorded none: scored again).
        return b.best_step, b.best_metrics or self.evaluate("validation")

    def _write_summary(
        self, validation: dict, test: dict, checkpoint: Path | None, weights_step: int | None = None, **extra
    ) -> dict:
        """The run's summary (``recsys_dist.train.summary.run_summary`` and ``extra``), written to
        ``summary.json`` by rank 0; returned on every rank. ``weights_step``: the step whose
        weights were scored (default: the last)."""
        summary = run_summary(
            self.run_dir,
            self._ctx.world_size,
            self._step,
            self.rows_trained,
            self.train_seconds,
            self.resumed_at_step,
            validation,
            test,
            checkpoint,
            self.best,
            keeps_best(self.job),
            self._clock.split(),
            weights_step=self._step if weights_step is None else weights_step,
        )
        summary.update(extra)
        if self._ctx.is_main:
            write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        return summary

    def _diverged(self) -> None:
        raise divergence_error(self._losses, self._step, self._model, latest_checkpoint(self.run_dir))

    def _log_train(self) -> None:
        """Global mean loss and samples/s since the last train line; one all_reduce."""
        elapsed = time.perf_counter() - self._t0
        loss, per_task, rows = train_window(
            self._losses, self._real_rows, self._ctx.world_size, self.job.features.tasks
        )
        if not math.isfinite(loss):  # identical on every rank (all-reduced), so all stop here
            self._diverged()
        sps = round(rows / elapsed, 1) if elapsed > 0 else None
        lr = {"lr_scale": round(self._schedule.scale(self._step - 1), 6)} if self._schedule.active else {}
        self._writer.write(
            split="train",
            step=self._step,
            epoch=self.epoch,
            loss=loss,
            **per_task,
            samples_per_s=sps,
            **lr,
            **(self._pipe.pop_times() if self._pipe else {}),
            **managed_metrics(self._model, "train"),
        )
        self._bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=sps, refresh=False)
        self.train_seconds += elapsed
        self.rows_trained += rows
        self._losses, self._real_rows = [], []
        self._t0 = time.perf_counter()
