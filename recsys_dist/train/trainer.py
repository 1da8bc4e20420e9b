"""The training job one rank runs: one :class:`Trainer` composed of its parts.

``recsys_dist.Trainer`` is the public entry point. Embedding tables are sharded by TorchRec's
planner and DistributedModelParallel; the dense tower is data-parallel. The Trainer builds three
parts and runs the step loop between them: a data source (``train.data_source``: ``EpochData``
over the converted splits, or ``train.stream.StreamData`` over landing partitions: batches,
position, what a checkpoint records of it), a step runner (``train.steps``: the pipelined step,
the LR schedule) and a recorder (``train.recorder``: ``metrics.jsonl``, progress bar, summary);
its checkpoints go through ``train.checkpointing``, its process group through ``train.lease``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import torch
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.dcp import latest_checkpoint
from recsys_dist.checkpoint.meta import read_meta
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.distributed.env import DistContext, broadcast_result
from recsys_dist.distributed.optim import dense_torch_optimizer
from recsys_dist.distributed.plan_io import plan_summary
from recsys_dist.distributed.rules import comms_problems
from recsys_dist.faults import maybe_fault
from recsys_dist.section import ConfigError
from recsys_dist.train.build import (
    DenseOptimizerFactory,
    Loaders,
    LRSchedulerFactory,
    ModelFactory,
    best_tracker,
    check_callbacks,
    check_given_once,
    check_lr_scheduler,
    keeps_best,
    model_for_run,
    require_ranks,
    write_plan,
)
from recsys_dist.train.callbacks import Callback, Hooks, HookTrainer
from recsys_dist.train.checkpointing import Checkpointer
from recsys_dist.train.data_source import DataSource, EpochData
from recsys_dist.train.evaluation import evaluate, predict
from recsys_dist.train.job import Job
from recsys_dist.train.lease import RunLease
from recsys_dist.train.observe import PhaseClock
from recsys_dist.train.pipelines import pipeline_problems
from recsys_dist.train.recorder import RunRecorder
from recsys_dist.train.results import FitSummary
from recsys_dist.train.steps import StepRunner
from recsys_dist.train.summary import divergence_error, ledger_line

log = logging.getLogger("recsys_dist")
__all__ = ["Callback", "HookTrainer", "Trainer"]
_TRAINERS_MADE = 0  # a process's first Trainer counts its startup from the process's start


class Trainer:
    """One rank's training job: data, sharded model, pipelined loop, evaluation, checkpoints.

    Every rank of the job builds one ``Trainer`` with the same config and run directory and
    calls the same methods in the same order (most of them are collective)::

        with Trainer(job, "runs/my_run") as trainer:
            summary = trainer.fit()  # train, validate each epoch, score test, save
            test = trainer.evaluate("test")
            preds = trainer.predict("test")

    The process group: when none exists, the Trainer creates it
    (``recsys_dist.distributed.env.init_distributed``: the launcher's ranks under torchrun or
    :func:`recsys_dist.launch`, else one rank in this process) and :meth:`close` destroys it;
    an existing group (made by the caller) is used as it is and left to its owner. A Trainer
    whose group was destroyed under it (its owner closed first) raises ``RuntimeError`` from
    its collective methods.

    Args:
        cfg: the run config (``recsys_dist.load_config``), which ``recsys_dist.Trainer``
            resolves once into a :class:`~recsys_dist.train.job.Job` and whose cross-section
            rules it checks first (``recsys_dist.train.preflight.check_sections``); or a resolved
            ``Job`` (``recsys-dist train``'s ranks), checked by whoever resolved it. (This class,
            ``recsys_dist.train.trainer.Trainer``, takes the Job only: ``job``.)
        run_dir: the run directory; created if missing (rank 0 writes ``config.yaml``,
            ``plan.txt`` / ``plan.json``, ``metrics.jsonl``, ``summary.json`` and
            ``checkpoints/`` there). A directory that already holds a run is not refused
            here, unlike ``recsys-dist train``; ``recsys_dist.checkpoint.run_dir.check_unused`` does it.
            Rank 0 holds the directory's lock (``RUN_DIR/.lock``) until :meth:`close`, unless
            the launcher that started it holds it; ``metrics.jsonl`` is cut to the step the
            run continues from (emptied when it starts from scratch).
        resume: None; ``"auto"`` (the newest complete checkpoint of ``run_dir`` whose files
            match their checksums, a damaged newer one skipped with a warning naming its file;
            a fresh start when there is none yet); ``"latest"`` / ``"best"`` of ``run_dir``; a
            checkpoint directory; or a run directory (its newest complete checkpoint). Any world
            size or plan may have written it.
        profile_dir: write a torch.profiler trace of steps 5-7 per rank there.
        model: the model as an ``nn.Module`` (tables in EmbeddingBagCollections /
            EmbeddingCollections, built on ``meta``: ``spec.embedding_device``), or a factory
            ``spec -> nn.Module`` called with the run's ``FeatureSpec`` (the table sizes the data
            preparation decided), instead of ``model.name``; the contract of a model named in
            YAML (docs/api.md). ``model.embedding_dim`` / ``embedding_init_scale`` still shape
            ``spec.tables``; no other ``model.*`` key may be set. (A run trained so has no
            ``model.name`` to rebuild its model from: ``load_model`` / ``recsys-dist export``
            do not apply; score it with :meth:`predict`.)
        dense_optimizer: a factory ``params -> torch.optim.Optimizer`` for the dense (non-table)
            parameters, e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)``, instead of
            ``train.dense_optimizer`` / ``dense_lr`` (which may then not be set). The tables keep
            ``train.embedding_optimizer``; ``train.dense_grad_clip_norm`` still clips.
        lr_scheduler: a factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler`` over the
            dense optimizer, stepped after every training step, instead of
            ``train.warmup_steps`` / ``decay_start_step`` / ``decay_steps`` (which may then not
            be set). Its state must follow from the step count alone (LambdaLR, StepLR,
            CosineAnnealingLR, ...): a resumed run steps it to the checkpoint's step again.
        callbacks: :class:`Callback` objects, called on every rank at each
            step's end and each validation's end.
        resume_on_new_data: resume although the training split differs from the one the
            checkpoint was trained on (its fingerprint, ``meta.json`` ``data``); refused
            otherwise. The checkpoint's epoch then starts again from its first batch over
            the new data (the next epoch when it had ended), steps continuing from the
            checkpoint's, and the run ends after ``train.epochs`` epochs.

    Attributes:
        job: the resolved run (its sections: ``job.train``, ``job.data``, ...; its facts:
            ``job.features``, ``job.fmt``, ...). cfg (``recsys_dist.Trainer`` only): the config
            given. run_dir: the run directory (``Path``).
        epoch: the epoch being (or last) trained, from 0.
        total_steps: steps the run trains in all (``train.epochs`` x steps per epoch, capped
            by ``train.max_steps``); :meth:`fit` stops there.
        rows_trained, train_seconds: real (unpadded) rows over all ranks and seconds spent
            training (evaluation excluded), so far; they continue across a resume.
        spec: the ``FeatureSpec`` (features, tables and their sizes) the data preparation decided.
        resumed_from, resumed_at_step: the checkpoint resumed from and its step, or None.
        best: the ``recsys_dist.train.early_stopping.BestTracker`` of ``train.early_stopping`` /
            ``checkpoint.keep_best`` (best validation value and step, early stop), or None.

    Raises:
        ConfigError: a problem across config sections (given a ``RunConfig``:
            ``recsys_dist.train.preflight.check_sections``); an option given both in the config and as an argument (``model`` with a
            ``model.*`` key other than ``embedding_dim`` / ``embedding_init_scale``;
            ``dense_optimizer`` with ``train.dense_optimizer`` / ``dense_lr``; ``lr_scheduler``
            with ``train.warmup_steps`` / ``decay_start_step`` / ``decay_steps``), naming both;
            ``distributed.nproc_per_node`` > 1 in a single process with neither a
            launcher nor a process group (it would train one rank only); ``train.pipeline``
            cannot run on the device (semi_sync, fused_sparse_dist off CUDA); the run directory
            cannot be written; another live run holds it (``recsys_dist.checkpoint.run_dir.RunDirLocked``).
        TypeError: ``model`` / ``dense_optimizer`` / ``lr_scheduler`` not callable, or a
            callback that is not a :class:`Callback`; ``lr_scheduler`` made no step-count
            ``LRScheduler`` (None, a ``ReduceLROnPlateau``), found before the first step.
        MetricsError: ``metrics.jsonl`` cannot be written (every rank raises it together).
        CheckpointError: ``resume`` is not a complete checkpoint, or one written by another
            model config; ``CheckpointDamaged``: a file of it differs from its checksum
            (``"auto"`` falls back to the newest intact one instead, with a warning).
        DataChanged (a ``ConfigError``): ``resume`` was trained on another training split
            and ``resume_on_new_data`` is False.
        DataError: the data cannot be converted or read.
    """

    source_type: type[DataSource] = EpochData  # what it trains on (StreamTrainer: StreamData)

    def __init__(
        self,
        job: Job,
        run_dir: str | Path,
        *,
        resume: str | Path | None = None,
        profile_dir: str | Path | None = None,
        model: nn.Module | ModelFactory | None = None,
        dense_optimizer: DenseOptimizerFactory | None = None,
        lr_scheduler: LRSchedulerFactory | None = None,
        callbacks: Sequence[Callback] = (),
        resume_on_new_data: bool = False,
    ) -> None:
        if not isinstance(job, Job):
            raise TypeError(
                f"the Trainer takes a resolved Job, got {type(job).__name__}; recsys_dist.Trainer takes a RunConfig"
            )
        if model is not None:
            job = job.given_model()
        check_given_once(job, model, dense_optimizer, lr_scheduler)
        check_callbacks(job, callbacks, Callback)
        require_ranks(job)
        self.job, self.run_dir = job, Path(run_dir)
        self._user_model, self._dense_factory, self._scheduler_factory = model, dense_optimizer, lr_scheduler
        self._hooks = Hooks(callbacks)  # a callback's exception: held, then raised on every rank
        self._resume_on_new_data = resume_on_new_data
        self._recorder = self._runner = None
        self._fit_failed: int | None = None  # the step a failed fit() stopped at
        self._lease = RunLease(job.distributed)  # the process group (made if none) and the run directory
        self._ctx = self._lease.ctx
        # Wall-time split for summary.json: everything up to here (imports, the process group) is startup.
        global _TRAINERS_MADE
        self._clock = PhaseClock.for_run(first_in_process=_TRAINERS_MADE == 0)
        _TRAINERS_MADE += 1
        try:
            self._setup(resume, Path(profile_dir) if profile_dir is not None else None)
        except BaseException:
            self._lease.failed = True
            self.close()
            raise

    def _setup(self, resume: str | Path | None, profile_dir: Path | None) -> None:
        job, ctx = self.job, self._ctx
        # Before the run directory is taken: a pipeline this device cannot run was refused only
        # at fit(), after config.yaml, the plan and the ledger line had been written there.
        problems = pipeline_problems(job.train.pipeline, ctx.device.type)
        problems += comms_problems(job.sharding.comms, ctx.device.type, ctx.world_size)
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
        self._lease.take_run_dir(self.run_dir)
        torch.manual_seed(job.train.seed)
        if job.train.deterministic:
            torch.use_deterministic_algorithms(True)
        # Rank 0 checks the checkpoint's checksums (auto: falls back past a damaged one) and
        # every rank takes its answer, so no two ranks load different checkpoints.
        checkpoint = broadcast_result(
            ctx, lambda: run_dirs.resolve_resume(resume, self.run_dir, flag="resume", warn=log.warning)
        )
        if resume == "auto" and checkpoint is None:
            log.warning("resume='auto': no complete checkpoint in %s yet; starting from scratch", self.run_dir)
        self._source = self.source_type(self)
        self.job = self._source.setup(checkpoint)
        self._setup_model()
        self._setup_loop(checkpoint, profile_dir)
        if checkpoint is not None:
            with self._clock.phase("checkpoint"):
                self._restore(checkpoint)
                self._runner.replay_lr_scheduler(self._step)
            self.resumed_at_step = self._step
        ledger = lambda: ledger_line(self.job, self._model, self._ctx.world_size)  # noqa: E731
        # the resumed step's lines written again: a stream's (config.yaml written first)
        self._recorder.start(self._step, self.epoch, ledger, self._source.stale_lines())

    def _setup_model(self) -> None:
        """The sharded model and its optimizer (and a user LR scheduler); plan.txt / plan.json."""
        job, ctx = self.job, self._ctx
        self.spec, self._model_hooks, self._model_data, self._model, self._optimizer, plan_text = model_for_run(
            job, ctx, self.loaders, self._clock, self._user_model, self._dense_factory
        )
        self._task = self._model.module  # the CTRTask: its hooks (managed-collision metrics)
        lr_scheduler = None
        if self._scheduler_factory is not None:
            lr_scheduler = check_lr_scheduler(self._scheduler_factory(dense_torch_optimizer(self._optimizer)))
        self._runner = StepRunner(self._model, self._optimizer, ctx.device, job.train, lr_scheduler)
        log.info("sharded: %s", ", ".join(sorted({r["sharding_type"] for r in plan_summary(self._model.plan)})))
        if ctx.is_main:
            write_plan(self.run_dir, self._model.plan, self.spec, plan_text)

    def _setup_loop(self, checkpoint: Path | None, profile_dir: Path | None) -> None:
        """The training loop's state at step 0 (a resume then restores it) and its recorder."""
        job, ctx, source = self.job, self._ctx, self._source
        resume_step = run_dirs.checkpoint_step(checkpoint) if checkpoint is not None else None
        self._recorder = RunRecorder(
            self.run_dir, ctx, resume_step, source.total_steps, job.train.progress_bar, profile_dir
        )
        self._step = 0
        self._last_val: tuple[int, dict] | None = None  # (step, metrics) of the latest validation
        self.best = best_tracker(job, source.steps_per_epoch or 1, source.global_batch)
        es = job.train.early_stopping  # restore_best without checkpoints: the best weights kept in memory
        in_memory = bool(es and es.restore_best and not job.checkpoint.enabled)
        self._ckpt = Checkpointer(self.run_dir, ctx, self._clock, self._model, self._optimizer, in_memory)
        self.resumed_from = checkpoint
        self.resumed_at_step = None

    # ------------------------------------------------------------------ what users read

    @property
    def model(self) -> DistributedModelParallel:
        """The sharded model (TorchRec ``DistributedModelParallel``). Its forward takes a
        ``CTRBatch`` and returns ``(loss, (loss, logits [B], labels [B], weights [B]))``.
        Under dense strategy pipeline, mid-training only this rank's stage of the tower is current
        (all of it after a validation or checkpoint: docs/design/pipeline.md)."""
        return self._model

    @property
    def optimizer(self) -> CombinedOptimizer:
        """The dense optimizer and the fused embedding optimizer, as one ``CombinedOptimizer``."""
        return self._optimizer

    @property
    def ctx(self) -> DistContext:
        """This rank's place in the job: rank, world size, device, backend."""
        return self._ctx

    @property
    def loaders(self) -> Loaders:
        """This rank's ``train`` (shuffled), ``validation`` and ``test`` loaders."""
        return self._source.loaders

    @property
    def clock(self) -> PhaseClock:
        """This rank's wall-time split (``wall_split``); ``trainer.clock.phase("publish")`` times a callback's work."""
        return self._clock

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (global: the same on every rank)."""
        return self._step

    @property
    def epoch(self) -> int:
        return self._source.epoch

    @property
    def total_steps(self) -> int | None:
        return self._source.total_steps

    @property
    def rows_trained(self) -> int:
        return self._recorder.rows_trained

    @property
    def train_seconds(self) -> float:
        return self._recorder.train_seconds

    def fit(self) -> FitSummary:  # a StreamTrainer's: a StreamSummary
        """Train ``train.epochs`` epochs (capped by ``train.max_steps``, and stopped early by
        ``train.early_stopping``), scoring the validation split after each one (and every
        ``eval.every_n_steps``; once at a step that is both), put back the best validation
        weights (``train.early_stopping.restore_best``, the default with early stopping), then
        score the test split, save the final checkpoint (when ``checkpoint.enabled``; it holds
        the weights scored, at the last step's position) and write ``summary.json``.
        Collective: every rank must call it. (A ``StreamTrainer`` trains the partitions of
        ``data.stream`` as they land instead: ``recsys_dist.train.stream.StreamData.run``.)

        Returns:
            The summary, as in ``summary.json``: ``run_dir``, ``world_size``, ``steps``,
            ``weights_step`` (the step whose weights ``validation`` and ``test`` are of),
            ``rows_trained``, ``train_seconds``, ``samples_per_s``, ``resumed_at_step``,
            ``validation`` and ``test`` (``auc``, ``logloss``, ``ne``; None where undefined),
            ``checkpoint`` (its path), ``wall_seconds`` and ``wall_split`` (seconds per
            phase of this rank's wall time, adding up to it: ``recsys_dist.train.observe.PhaseClock``);
            with early stopping or ``checkpoint.keep_best``, ``best`` (``metric``, ``value``,
            ``step``, ``early_stopped``, and ``checkpoint``: the best one kept, or None). When the
            checkpoint resumed from is at the last step nothing is trained or written: the run's
            ``summary.json`` (if any) with ``run_dir`` this Trainer's, ``steps`` the checkpoint's,
            ``resumed_from`` its path and ``already_complete: True``.

        Raises:
            FloatingPointError: the training loss became non-finite (names the step, the
                first non-finite parameter and the last good checkpoint).
            CheckpointError: a checkpoint could not be written (on every rank).
            RuntimeError: an earlier ``fit()`` of this Trainer failed (use a new one, ``resume="auto"``).
        """
        if self._fit_failed is not None:  # its pipeline and loaders stopped mid-batch: not resumable in place
            msg = f"this Trainer's fit() failed at step {self._fit_failed}; build a new Trainer with resume='auto'"
            raise RuntimeError(msg + " (its last checkpoint) to continue")
        try:
            return self._fit()
        except BaseException:
            self._fit_failed = self._step
            raise

    def _fit(self):
        with self._lease.collective(), self._source.stop_signals():
            if self.resumed_from is not None and self._source.nothing_left(self._step):  # report it, change nothing
                log.warning(
                    "checkpoint %s is already at the last step (%d); nothing to train", self.resumed_from, self._step
                )
                return run_dirs.noop_summary(self.run_dir, self.resumed_from, self._step)
            if self.resumed_from is not None:  # once a Trainer: a second fit() has not resumed
                self._hooks.resume(self, self._step, self.resumed_from)
            return self._source.run()

    def train_epoch(self) -> dict:
        """Train the next epoch (its rest, when resumed mid-epoch; nothing past
        ``total_steps``), then score the validation split. Collective.

        Returns:
            The validation metrics (as :meth:`evaluate`), also written to ``metrics.jsonl``.
        """
        with self._lease.collective(), self._clock.phase("train"):  # its validation counts as eval
            return self._source.train_epoch()

    def evaluate(self, split: str | ParquetBatchLoader = "validation") -> dict[str, float]:
        """Global metrics of the model on ``"validation"``, ``"test"`` or ``"train"`` (every
        row once, unshuffled), or on a loader of this rank's share of other data. Collective:
        every rank must call it; every rank gets the same dict. Writes nothing.

        Returns:
            ``auc``, ``logloss``, ``ne``, ``calibration``, ``accuracy``, ``num_examples``
            (floats; NaN where undefined, e.g. AUC on one class), plus ``gauc`` with
            ``eval.group_feature`` and ``auc_error_bound`` with ``eval.auc_buckets``;
            ``{}`` for an empty split. Several tasks (``data.schema.labels``): per task
            ``<task>/auc``, ``<task>/logloss``, ``<task>/ne``, ``<task>/calibration``,
            ``<task>/accuracy`` (binary) or ``<task>/rmse``, ``<task>/mae`` (regression), and
            ``<task>/weight_sum``; weighted by the sample weights (``data.schema.weight``).
            Plus the model's ``evaluator`` hook's metrics (``ModelSpec``): a retrieval model
            (``two_tower``) on ``"validation"`` / ``"test"`` also gets ``recall@K``, ``ndcg@K``,
            ``popular_recall@K``, ``popular_ndcg@K`` (K of ``eval.retrieval_k``),
            ``retrieval_users`` and ``corpus_items`` (``recsys_dist.models.retrieval``).

        Raises:
            ValueError: an unknown split name.
        """
        with self._lease.collective(), self._clock.phase("eval"):
            self._detach_pipeline()
            c = self.job.eval
            names, kinds = self.job.features.tasks, self.job.features.task_kinds
            metrics = evaluate(
                self._model,
                self._source.loader(split),
                self._ctx.device,
                c.auc_buckets,
                c.group_feature,
                tasks=(names, kinds) if names != ["label"] else None,
            )
            if self._model_hooks.evaluator is not None:  # the model's own (two_tower: recall@K, ...)
                metrics.update(
                    self._model_hooks.evaluator(self._model, self._model_data, split, self.job, self._ctx.device)
                )
            return metrics

    def predict(self, split: str | ParquetBatchLoader = "test") -> dict[str, torch.Tensor]:
        """Per-row predictions on a split (``"validation"``, ``"test"``, ``"train"``) or on an
        unshuffled loader, gathered in the files' row order onto every rank. Collective.

        Returns:
            ``{"logit", "probability", "label"}``: float32 CPU tensors of shape [N], N = the
            split's rows, identical on every rank (O(N) memory per rank).

        Raises:
            ValueError: an unknown split name, or a shuffled loader.
        """
        with self._lease.collective(), self._clock.phase("eval"):
            self._detach_pipeline()
            return predict(self._model, self._source.loader(split), self._ctx.device)

    def save_checkpoint(self, best: bool = False) -> Path:
        """Write a sharded checkpoint of the current step (weights, optimizer state, RNG,
        loader position, early-stopping state, plan and config) to
        ``run_dir/checkpoints/step_N``, atomically, keeping the newest ``checkpoint.keep`` and
        the best one. ``best``: mark this one ``checkpoints/best``. Collective.

        Returns:
            The checkpoint directory.

        Raises:
            CheckpointError: on every rank, when any rank cannot write; the previous
                checkpoint is left as it was.
        """
        with self._lease.collective(), self._clock.phase("checkpoint"):
            path = self._ckpt.save(self._step, self._checkpoint_meta(), self.job, self._source, best=best)
        self._hooks.checkpoint(self, self._step, path)
        return path

    def close(self) -> None:
        """Release the Trainer: destroy the process group if this Trainer created it, after a
        barrier, so no rank tears gloo down while a peer still has work queued. Idempotent.

        After an error on this rank there is no barrier (a peer may be stuck in a
        collective): a one-rank group is destroyed, a larger one is left to the end of the
        process (the launcher ends the peers).
        """
        if self._lease.closed:
            return
        self._lease.closed = True
        if self._recorder is not None:
            self._recorder.close()
        self._lease.release()

    def __enter__(self) -> Self:  # a StreamTrainer's is a StreamTrainer
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._lease.failed = True
        self.close()

    # ------------------------------------------------------------------ the loop

    def _done(self) -> bool:
        return self._source.done(self._step)

    def _train_steps(self, start: int) -> None:
        """Train the source's batches of the current epoch / partition from its global batch
        ``start`` to its end, ``total_steps`` or a stop; checkpoints by cadence on the way."""
        job, ctx, source, rec, runner = self.job, self._ctx, self._source, self._recorder, self._runner
        runner.start(self._step)
        self._ckpt.weights_step = None  # trained on: the weights are the step's own again
        batches = source.batches(start)
        rec.open_window()
        while not self._done():
            rec.tracer.before(self._step + 1)
            out = runner.progress(batches, self._step)
            if out is None:
                break
            self._step += 1
            source.in_epoch += 1
            maybe_fault("step", self._step, ctx.rank)
            rec.tracer.after(self._step)
            rec.add_loss(out[0].detach())
            rec.add_rows(out[3])
            runner.after_step()
            # A step validated (the epoch's last: after the loop) raises a callback's exception once validated, saved
            validates = job.eval.every_n_steps and self._step % job.eval.every_n_steps == 0
            last = source.in_epoch >= len(source.loaders.train) or self._done()  # a partition's last: once saved
            self._hooks.step_end(self, self._step, out[0].detach(), check=not (last or validates))
            if self._step % job.train.log_every_n_steps == 0:
                self._log_train()
            if source.should_stop(self._step):
                break
            if last:
                continue
            if validates:
                source.validate()  # detaches the pipeline (evaluate); its next progress re-attaches
                if self._done():  # early stopping: every rank decides alike (global metrics)
                    break
                self._hooks.raise_failure(self)  # a callback raised: the step saved, every rank raises
                rec.restart_clock()
            if self._checkpoint_due():
                self._save_in_window()
            if self._ckpt.saved_step == self._step and runner.restarts_at_checkpoint:
                runner.restart(self._step)  # a mid-epoch checkpoint (cadence, new best): see train.pipelines
                batches = source.loaders.train.iter_from(source.in_epoch)
                rec.restart_clock()
        if rec.losses and not source.keeps_window():
            self._log_train()
        runner.pipe.detach()

    def _log_train(self) -> None:
        """Global mean loss and samples/s since the last train line; one all_reduce."""

        def fields() -> dict:
            return {**self._runner.log_fields(self._step), **self._task.managed_metrics("train")}

        def diverged() -> None:
            raise divergence_error(self._recorder.losses, self._step, self._model, latest_checkpoint(self.run_dir))

        self._recorder.log_train(self._step, self.epoch, self.job.features.tasks, fields, diverged)

    def _checkpoint_due(self) -> bool:
        return self._ckpt.due(self.job.checkpoint, self._step, self._done())

    def _save_in_window(self, best: bool = False) -> None:
        if self._recorder.losses:  # close the logging window here, so a resumed run logs the same lines
            self._log_train()
        self.save_checkpoint(best=best)
        self._recorder.restart_clock()

    def _detach_pipeline(self) -> None:
        if self._runner is not None:
            self._runner.detach()

    # ------------------------------------------------------------------ checkpoints and the end

    def _checkpoint_meta(self) -> dict:
        """What a checkpoint's meta.json records besides its tensors: position, plan, config, data."""
        source = self._source
        meta = {
            "step": self._step,
            "epoch": self.epoch,
            "batches_in_epoch": source.in_epoch,
            "rows_trained": self.rows_trained,
            "train_seconds": self.train_seconds,
            "world_size": self._ctx.world_size,
            "plan": plan_summary(self._model.plan),
            "config": self.job.to_dict(),
            "num_embeddings": self.loaders.num_embeddings,
            "early_stopping": self.best.state() if self.best is not None else None,
            # Not the step's own after restore_best put back the best validation's weights.
            "weights_step": self._step if self._ckpt.weights_step is None else self._ckpt.weights_step,
            # The training data (recsys_dist.checkpoint.run_dir.check_same_data) and where its epochs start.
            "data": source.data,
            "steps_per_epoch": source.steps_per_epoch,
            "step_offset": source.step_offset,
        }
        if self._user_model is not None:  # config.model names no model: export/load_model refuse it
            meta["user_model"] = True
        return {**meta, **source.checkpoint_meta()}

    def _restore(self, path: Path) -> None:
        """Continue from a checkpoint: weights, optimizer state, RNG and the data position."""
        meta = read_meta(path)
        source, rec = self._source, self._recorder
        self._ckpt.load(path, meta, self.job, source.global_batch, self.loaders.num_embeddings, self._user_model)
        self._step = meta["step"]
        rec.rows_trained, rec.train_seconds = meta["rows_trained"], meta["train_seconds"]
        if self.best is not None:
            self.best.load(meta.get("early_stopping"))
        if meta.get("weights_step", self._step) != self._step and not self._done() and self._ctx.is_main:
            self._ckpt.warn_weights(path, meta)
        self._source.restore_position(path, meta)
        self._recorder.bar.update(self._step)

    def _write_summary(
        self, validation: dict, test: dict, checkpoint: Path | None, weights_step: int | None = None, **extra
    ) -> dict:
        """The run's summary (``recsys_dist.train.summary.run_summary`` and ``extra``), written to
        ``summary.json`` by rank 0; returned on every rank. ``weights_step``: the step whose
        weights were scored (default: the last)."""
        rest = (self.best, keeps_best(self.job), self._clock.split(), weights_step)
        summary = self._recorder.summary(self._step, self.resumed_at_step, validation, test, checkpoint, *rest)
        summary.update(extra)
        return self._recorder.write_summary(summary)
