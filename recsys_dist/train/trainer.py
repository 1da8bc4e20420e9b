"""The training job one rank runs: data, sharded model, pipelined loop, evaluation.

:class:`Trainer` is the public entry point (``recsys_dist.Trainer``); :func:`train` is the
command line's one call over it. Hybrid parallelism: embedding tables are sharded by
TorchRec's planner and DistributedModelParallel (DMP); the dense tower is data-parallel
(DDP inside DMP). ``TrainPipelineSparseDist`` overlaps the input_dist all-to-all of batch
i+1 with the forward/backward of batch i. Evaluation lives in ``recsys_dist.train.evaluation``,
``metrics.jsonl`` in ``recsys_dist.train.metrics_writer``, run-directory rules in
``recsys_dist.checkpoint.run_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer
from tqdm import tqdm

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.dcp import (
    canonical_optimizer_state,
    check_compatible,
    checkpoint_keys,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    set_optimizer_steps,
)
from recsys_dist.config.base import ConfigError
from recsys_dist.config.run import RunConfig
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.distributed import sharding
from recsys_dist.distributed.env import (
    DistContext,
    broadcast_result,
    check_reusable,
    init_distributed,
    note_failure,
)
from recsys_dist.distributed.ledger import run_ledger
from recsys_dist.distributed.optim import dense_torch_optimizer, init_lazy_state
from recsys_dist.faults import maybe_fault
from recsys_dist.models.managed import managed_metrics
from recsys_dist.models.registry import get_model
from recsys_dist.models.retrieval import read_retrieval_data, retrieval_metrics
from recsys_dist.train.build import (
    DenseOptimizerFactory,
    Loaders,
    LRSchedulerFactory,
    ModelFactory,
    check_given_once,
    check_lr_scheduler,
    make_loaders,
    require_ranks,
    shard_model,
)
from recsys_dist.train.early_stopping import BestTracker
from recsys_dist.train.evaluation import evaluate, in_row_order, predict
from recsys_dist.train.job import Job, resolve_job
from recsys_dist.train.metrics_writer import MetricsWriter, finite_or_none
from recsys_dist.train.observe import PhaseClock, TraceWriter
from recsys_dist.train.pipelines import RESTART_AT_CHECKPOINT, make_pipeline, pipeline_problems
from recsys_dist.train.preflight import check_sections
from recsys_dist.train.schedule import LRSchedule
from recsys_dist.train.summary import run_summary

log = logging.getLogger("recsys_dist")
_TRAINERS_MADE = 0  # a process's first Trainer counts its startup from the process's start


class Callback:
    """Hooks the :class:`Trainer` calls (``Trainer(callbacks=[...])``: subclass it and override what you need) on every rank, in the order of its
    ``callbacks`` list. They run inside the training loop: a collective in one must run on every
    rank (the Trainer calls each hook on every rank at the same point); an exception stops the run."""

    def on_step_end(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        """After optimizer step ``step`` (global, from 1; ``trainer.step`` equals it).

        ``loss``: this rank's training loss of the step, detached, times the batch's
        ``loss_scale`` (float32 scalar; ``[1 + T]`` with several tasks: the total, then each
        task's). Reading its value (``float(loss)``) waits for the step to finish; the
        global mean is in ``metrics.jsonl`` every ``train.log_every_n_steps``."""

    def on_validation_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """After each validation (every epoch's end and every ``eval.every_n_steps``), with the
        global metrics written to ``metrics.jsonl`` (the same dict on every rank)."""


class Trainer:
    """One rank's training job: data, sharded model, pipelined loop, evaluation, checkpoints.

    Every rank of the job builds one ``Trainer`` with the same config and run directory and
    calls the same methods in the same order (most of them are collective)::

        with Trainer(cfg, "runs/my_run") as trainer:
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
        cfg: the run config (``recsys_dist.config.load_config``), whose cross-section rules
            the Trainer checks first (``recsys_dist.train.preflight.check_sections``); or a
            resolved :class:`~recsys_dist.train.job.Job` (``recsys-dist train``'s ranks),
            checked by whoever resolved it.
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
        cfg: the config. run_dir: the run directory (``Path``).
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
        ConfigError: an option given both in the config and as an argument (``model`` with a
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

    def __init__(
        self,
        cfg: RunConfig | Job,
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
        if not isinstance(cfg, Job):  # checked once here (recsys-dist train's ranks get a checked Job)
            cfg = resolve_job(cfg)
            check_sections(cfg)
        job, cfg = cfg, cfg.cfg
        check_given_once(cfg, model, dense_optimizer, lr_scheduler)
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be recsys_dist.Callback objects, got {type(cb).__name__}")
        require_ranks(cfg)
        self.cfg, self.run_dir, self._job = cfg, Path(run_dir), job
        self._user_model, self._dense_factory, self._scheduler_factory = model, dense_optimizer, lr_scheduler
        self._callbacks = list(callbacks)
        self._lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._resume_on_new_data = resume_on_new_data
        self._owns_group = not dist.is_initialized()
        self._closed = self._failed = False
        self._bar = self._writer = self._tracer = self._lock = None
        self._ctx = init_distributed(cfg)
        self._group = dist.group.WORLD  # the group this Trainer trains on (it may outlive it)
        if not self._owns_group and check_reusable(self._ctx.rank, self._ctx.world_size):
            self._owns_group = True  # left open by a Trainer that failed on every rank: now ours to close
        # Wall-time split for summary.json: everything up to here (imports, the process group) is startup.
        global _TRAINERS_MADE
        self._clock = PhaseClock.for_run(first_in_process=_TRAINERS_MADE == 0)
        _TRAINERS_MADE += 1
        try:
            self._setup(resume, Path(profile_dir) if profile_dir is not None else None)
        except BaseException:
            self._failed = True
            self.close()
            raise

    def _setup(self, resume: str | Path | None, profile_dir: Path | None) -> None:
        cfg, ctx = self.cfg, self._ctx
        # Before the run directory is taken: a pipeline this device cannot run was refused only
        # at fit(), after config.yaml, the plan and the ledger line had been written there.
        problems = pipeline_problems(cfg.train.pipeline, ctx.device.type)
        problems += sharding.comms_problems(cfg.sharding.comms, ctx.device.type, ctx.world_size)
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
        self._take_run_dir()
        torch.manual_seed(cfg.train.seed)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        # Rank 0 checks the checkpoint's checksums (auto: falls back past a damaged one) and
        # every rank takes its answer, so no two ranks load different checkpoints.
        checkpoint = broadcast_result(
            ctx, lambda: run_dirs.resolve_resume(resume, self.run_dir, flag="resume", warn=log.warning)
        )
        if resume == "auto" and checkpoint is None:
            log.warning("resume='auto': no complete checkpoint in %s yet; starting from scratch", self.run_dir)
        with self._clock.phase("data"):
            self._loaders = make_loaders(self._job, ctx)  # converts the data; decides the table sizes
        self._job = self._job.with_data(self._loaders.prepared)
        # The training split's identity, recorded in each checkpoint; a resume on another one
        # is refused unless resume_on_new_data (then its epoch starts again: resume_position).
        conversion = self._loaders.conversion
        self._data = broadcast_result(
            ctx, lambda: run_dirs.data_identity(conversion, cfg.data.raw_path) if conversion is not None else None
        )
        meta = read_meta(checkpoint) if checkpoint is not None else None
        flag = "resume_on_new_data=True (on the command line --resume-on-new-data)"
        self._new_data = meta is not None and run_dirs.check_same_data(
            checkpoint, meta, self._data, self._resume_on_new_data, flag
        )
        per_epoch = len(self._loaders.train)
        self._global_batch = cfg.train.batch_size * ctx.world_size  # a checkpoint's position is in its own
        self._resume_epoch, self._step_offset = (
            run_dirs.resume_position(meta, per_epoch, self._new_data, self._global_batch)
            if meta is not None
            else (0, 0)
        )
        self.total_steps = run_dirs.total_steps(cfg, per_epoch, self._step_offset)
        # A resumed run replaces config.yaml only when there is something left to train.
        done = checkpoint is not None and run_dirs.checkpoint_step(checkpoint) >= self.total_steps
        broadcast_result(ctx, lambda: run_dirs.write_config(cfg, self.run_dir, write=not done))
        log.info(
            "data ready: %d train / %d validation / %d test rows, %d steps per epoch",
            self._loaders.train.num_rows,
            self._loaders.validation.num_rows,
            self._loaders.test.num_rows,
            len(self._loaders.train),
        )
        self.spec = self._job.features.on(torch.device("meta"), ctx.device)
        # A retrieval model (two_tower): the item corpus and evaluated users, read once on rank
        # 0; the training split's item counts go to the model (logQ correction).
        self._retrieval = None
        if get_model(cfg.model.name).retrieval:
            loaders, sizes = self._loaders, self._loaders.num_embeddings
            paths = {s: [str(f) for f in getattr(loaders, s).files] for s in ("train", "validation", "test")}
            self._retrieval = broadcast_result(ctx, lambda: read_retrieval_data(cfg, paths, sizes))
            self.spec = dataclasses.replace(self.spec, id_counts={cfg.model.item_id: self._retrieval.train_counts})
        self._model, self._optimizer, plan_text = shard_model(
            self._job, ctx, self.spec, self._clock, self._user_model, self._dense_factory
        )
        if self._scheduler_factory is not None:
            self._lr_scheduler = check_lr_scheduler(self._scheduler_factory(dense_torch_optimizer(self._optimizer)))
        log.info(
            "sharded: %s", ", ".join(sorted({r["sharding_type"] for r in sharding.plan_summary(self._model.plan)}))
        )
        if ctx.is_main:
            (self.run_dir / "plan.txt").write_text(plan_text + "\n")
            (self.run_dir / "plan.json").write_text(
                json.dumps(sharding.plan_summary(self._model.plan, self.spec.planned_tables()), indent=2)
            )
        resume_step = run_dirs.checkpoint_step(checkpoint) if checkpoint is not None else None
        self._writer = MetricsWriter(self.run_dir / "metrics.jsonl", ctx.is_main, ctx.world_size, resume_step)
        self._tracer = TraceWriter(profile_dir, ctx.rank)
        t = cfg.train
        self._schedule = LRSchedule(t.warmup_steps, t.decay_start_step, t.decay_steps)
        self._base_lrs = [g["lr"] for g in self._optimizer.param_groups]
        self._pipe = None
        self._step = self.epoch = self.rows_trained = 0
        self._next_epoch = self._first_epoch = self._in_epoch = 0
        self.train_seconds = 0.0
        self._losses: list = []
        self._real_rows: list = []
        self._early_batches = None  # the next epoch's batches, opened during this epoch's validation
        self._last_val: tuple[int, dict] | None = None  # (step, metrics) of the latest validation
        self._saved_step: int | None = None  # the step of the checkpoint written last
        es = t.early_stopping
        self.best = (
            BestTracker(es.metric, es.patience, es.min_delta)
            if es is not None
            else BestTracker("auc")
            if cfg.checkpoint.keep_best
            else None
        )
        self._t0 = time.perf_counter()
        self._bar = tqdm(
            total=self.total_steps,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            leave=False,
            disable=not (ctx.is_main and t.progress_bar),
        )
        self.resumed_from = checkpoint
        self.resumed_at_step = None
        if checkpoint is not None:
            with self._clock.phase("checkpoint"):
                self._restore(checkpoint)
                self._replay_lr_scheduler()
            self.resumed_at_step = self._step
        # Lines past the step this run starts from (all of them when it starts from scratch)
        # are written again: each (split, step) once, whatever restarted the run.
        broadcast_result(ctx, lambda: self._writer.start(self._step))
        # The bytes one step moves (recsys_dist.distributed.ledger): written when it differs from the
        # run's last ledger line (a first start, or a resume on another plan or world size),
        # so a resumed run leaves the same lines as an uninterrupted one.
        ledger = json.loads(json.dumps(finite_or_none(run_ledger(cfg, self._model, ctx.world_size).to_dict())))

        def ledger_changed() -> bool:
            last = self._writer.last("ledger")
            return last is None or {k: last.get(k) for k in ledger} != ledger

        if broadcast_result(ctx, ledger_changed):
            self._writer.write(split="ledger", step=self._step, epoch=self.epoch, **ledger)

    # ------------------------------------------------------------------ what users read

    @property
    def model(self) -> DistributedModelParallel:
        """The sharded model (TorchRec ``DistributedModelParallel``). Its forward takes a
        ``CTRBatch`` and returns ``(loss, (loss, logits [B], labels [B], weights [B]))``."""
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
        return self._loaders

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (global: the same on every rank)."""
        return self._step

    # ------------------------------------------------------------------ the job

    def fit(self) -> dict:
        """Train ``train.epochs`` epochs (capped by ``train.max_steps``, and stopped early by
        ``train.early_stopping``), scoring the validation split after each one (and every
        ``eval.every_n_steps``; once at a step that is both), then score the test split, save
        the final checkpoint (when ``checkpoint.enabled``) and write ``summary.json``.
        Collective: every rank must call it.

        Returns:
            The summary, as in ``summary.json``: ``run_dir``, ``world_size``, ``steps``,
            ``rows_trained``, ``train_seconds``, ``samples_per_s``, ``resumed_at_step``,
            ``validation`` and ``test`` (``auc``, ``logloss``, ``ne``; None where undefined),
            ``checkpoint`` (its path), ``wall_seconds`` and ``wall_split`` (seconds per
            phase of this rank's wall time, adding up to it: ``recsys_dist.train.observe.PhaseClock``);
            with early stopping or ``checkpoint.keep_best``, ``best`` (``metric``, ``value``,
            ``step``, ``early_stopped``, and ``checkpoint``: the best one kept, or None). When
            the checkpoint resumed from is already at the
            last step nothing is trained or written: the run's ``summary.json`` (if any) with
            ``run_dir`` this Trainer's, ``steps`` the checkpoint's, ``resumed_from`` its path and
            ``already_complete: True``.

        Raises:
            FloatingPointError: the training loss became non-finite (names the step, the
                first non-finite parameter and the last good checkpoint).
            CheckpointError: a checkpoint could not be written (on every rank).
        """
        with self._collective():
            if self.resumed_from is not None and self._done():  # report it, change nothing
                log.warning(
                    "checkpoint %s is already at the last step (%d); nothing to train", self.resumed_from, self._step
                )
                return run_dirs.noop_summary(self.run_dir, self.resumed_from, self._step)
            last_val: dict = {}
            while self._next_epoch < self.cfg.train.epochs and not self._done():
                last_val = self.train_epoch() or last_val
            self._tracer.close()
            self._bar.close()
            test = self.evaluate("test")
            managed = managed_metrics(self._model, "test")
            self._writer.write(split="test", step=self._step, epoch=self.epoch, **test, **managed)
            c = self.cfg.checkpoint
            summary = run_summary(
                self.run_dir,
                self._ctx.world_size,
                self._step,
                self.rows_trained,
                self.train_seconds,
                self.resumed_at_step,
                last_val,
                test,
                self.save_checkpoint() if c.enabled else None,
                self.best,
                c.keep_best,
                self._clock.split(),
            )
            if self._ctx.is_main:
                (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            return summary

    def train_epoch(self) -> dict:
        """Train the next epoch (its rest, when resumed mid-epoch; nothing past
        ``total_steps``), then score the validation split. Collective.

        Returns:
            The validation metrics (as :meth:`evaluate`), also written to ``metrics.jsonl``.
        """
        with self._collective(), self._clock.phase("train"):  # its validation counts as eval
            self.epoch = self._next_epoch
            metrics = self._run_epoch()
            self._next_epoch += 1
            return metrics

    def evaluate(self, split: str | ParquetBatchLoader = "validation") -> dict:
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
            A retrieval model (``two_tower``) on ``"validation"`` / ``"test"`` also gets
            ``recall@K``, ``ndcg@K``, ``popular_recall@K``, ``popular_ndcg@K`` (K of
            ``eval.retrieval_k``), ``retrieval_users`` and ``corpus_items``
            (``recsys_dist.models.retrieval``).

        Raises:
            ValueError: an unknown split name.
        """
        with self._collective(), self._clock.phase("eval"):
            self._detach_pipeline()
            c = self.cfg.eval
            names, kinds = self._job.tasks
            metrics = evaluate(
                self._model,
                self._loader(split),
                self._ctx.device,
                c.auc_buckets,
                c.group_feature,
                tasks=(names, kinds) if names != ["label"] else None,
            )
            if self._retrieval is not None and split in ("validation", "test"):
                bs = c.batch_size or self.cfg.train.batch_size
                metrics.update(
                    retrieval_metrics(self._model, self._retrieval, split, c.retrieval_k, bs, self._ctx.device)
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
        with self._collective(), self._clock.phase("eval"):
            self._detach_pipeline()
            return predict(self._model, self._loader(split), self._ctx.device)

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
        with self._collective(), self._clock.phase("checkpoint"):
            meta = {
                "step": self._step,
                "epoch": self.epoch,
                "batches_in_epoch": self._in_epoch,
                "rows_trained": self.rows_trained,
                "train_seconds": self.train_seconds,
                "world_size": self._ctx.world_size,
                "plan": sharding.plan_summary(self._model.plan),
                "config": self.cfg.to_dict(),
                "num_embeddings": self._loaders.num_embeddings,
                "early_stopping": self.best.state() if self.best is not None else None,
                # The training data (recsys_dist.checkpoint.run_dir.check_same_data) and where its epochs start.
                "data": self._data,
                "steps_per_epoch": len(self._loaders.train),
                "step_offset": self._step_offset,
            }
            if self._user_model is not None:  # config.model names no model: export/load_model refuse it
                meta["user_model"] = True
            c = self.cfg.checkpoint
            path = save_checkpoint(self._ctx, self.run_dir, self._step, self._state(), meta, c.keep, best=best)
            self._saved_step = self._step
            if self._ctx.is_main:
                self._pin_preprocessing(path)
            return path

    def _pin_preprocessing(self, path: Path) -> None:
        # How inputs are mapped (vocabulary, sizes, transforms) travels with the checkpoint,
        # so export and predict never read the training data again (recsys_dist.serve.scoring).
        from recsys_dist.serve.scoring import MANIFEST_FILE, Preprocessing  # serve is the layer above

        conversion = self._loaders.conversion
        manifest = json.loads((conversion / MANIFEST_FILE).read_text()) if conversion is not None else None
        try:
            Preprocessing.describe(self.cfg, self._loaders.num_embeddings, conversion, manifest).save(path)
        except OSError as err:  # the checkpoint is complete without it; scoring falls back to the cache
            log.warning("could not write the preprocessing record into %s (%s)", path, err)

    def close(self) -> None:
        """Release the Trainer: destroy the process group if this Trainer created it, after a
        barrier, so no rank tears gloo down while a peer still has work queued. Idempotent.

        After an error on this rank there is no barrier (a peer may be stuck in a
        collective): a one-rank group is destroyed, a larger one is left to the end of the
        process (the launcher ends the peers).
        """
        if self._closed:
            return
        self._closed = True
        for part in (self._bar, self._tracer, self._writer):
            if part is not None:
                part.close()
        if self._lock is not None:
            self._lock.release()
        if not dist.is_initialized() or dist.group.WORLD is not self._group:
            return  # already destroyed (a group made since then belongs to someone else)
        if self._failed and self._ctx.world_size > 1:
            note_failure(self._ctx.rank)  # what a next Trainer in these ranks checks (check_reusable)
        if not self._owns_group:
            return
        if not self._failed:
            # Every rank leaves its last collective before any rank tears down gloo; a rank that
            # exited while a peer still had work queued made the peer abort.
            dist.barrier()
        if not self._failed or self._ctx.world_size == 1:
            dist.destroy_process_group()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._failed = True
        self.close()

    # ------------------------------------------------------------------ internals

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
        check_compatible(
            path,
            meta,
            self.cfg.to_dict(),
            sizes=self._loaders.num_embeddings,
            world_size=self._ctx.world_size,
            user_model=self._user_model is not None,
        )
        init_lazy_state(self._optimizer, self._model.fused_optimizer)
        state, saved = self._state(), checkpoint_keys(path)
        if "rng" in saved:  # written before per-rank states: one state, which every rank gets
            state["rng"] = torch.get_rng_state()
        elif meta.get("world_size") != self._ctx.world_size:  # no rank's random stream continues
            del state["rng"]
        load_checkpoint(path, state, verify=False)  # verified in _setup; in place: the state dicts are views
        set_optimizer_steps(self._optimizer, meta["step"])
        if "rng" in state:
            rng = state["rng"]
            torch.set_rng_state(rng if isinstance(rng, torch.Tensor) else rng[f"rank_{self._ctx.rank}"])
        self._step, self.rows_trained = meta["step"], meta["rows_trained"]
        self.train_seconds = meta["train_seconds"]
        if self.best is not None:
            self.best.load(meta.get("early_stopping"))
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
        self._bar.update(self._step)
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
        cfg, ctx = self.cfg, self._ctx
        pipe = self._pipe = self._new_pipeline()
        self._loaders.train.set_epoch(self.epoch)
        # The first epoch after a resume continues at the checkpoint's batch; later ones start at 0.
        start, self._in_epoch = (self._in_epoch, self._in_epoch) if self.epoch == self._first_epoch else (0, 0)
        early, self._early_batches = self._early_batches, None
        batches = early if early is not None and start == 0 else self._loaders.train.iter_from(start)
        self._t0 = time.perf_counter()
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
            if self._step % cfg.train.log_every_n_steps == 0:
                self._log_train()
            if self._in_epoch >= len(self._loaders.train) or self._done():
                # The epoch's (or run's) last step: validated, then checkpointed, after the loop.
                continue
            if cfg.eval.every_n_steps and self._step % cfg.eval.every_n_steps == 0:
                self._validate()  # detaches the pipeline (evaluate); its next progress re-attaches
                if self._done():  # early stopping: every rank decides alike (global metrics)
                    break
                self._t0 = time.perf_counter()
            if self._checkpoint_due():
                self._save_in_window()
            if self._saved_step == self._step and cfg.train.pipeline in RESTART_AT_CHECKPOINT:
                # A checkpoint (by cadence or a new best) mid-epoch: see recsys_dist.train.pipelines.
                pipe.detach()
                pipe = self._pipe = self._new_pipeline()
                batches = self._loaders.train.iter_from(self._in_epoch)
                self._t0 = time.perf_counter()
        if self._losses:
            self._log_train()
        pipe.detach()
        if self.epoch + 1 < cfg.train.epochs and not self._done():
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

    def _checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every_n_steps
        return (
            self.cfg.checkpoint.enabled
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

    def _new_pipeline(self):
        # Sampling counts global steps, so timed steps do not restart with each epoch.
        t = self.cfg.train
        pipe = make_pipeline(t.pipeline, self._model, self._optimizer, self._ctx.device, t.timing_every_n_steps)
        pipe.steps_done = self._step
        return pipe

    def _validate(self) -> dict:
        """Score the validation split once per step (a step both an epoch's end and a multiple
        of eval.every_n_steps is scored once), log it, update the best / early stopping and,
        with checkpoint.keep_best, save a new best checkpoint."""
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
                log.info(
                    "early stopping at step %d: validation %s has not improved for %d validations (best %.6g at step %s)",
                    self._step,
                    self.best.metric,
                    self.best.bad,
                    self.best.best if self.best.best is not None else float("nan"),
                    self.best.best_step,
                )
            if improved and self.cfg.checkpoint.enabled and self.cfg.checkpoint.keep_best:
                self._save_in_window(best=True)
        return metrics

    def _diverged(self) -> None:
        """Stop with the first bad step of this window, the first non-finite parameter and
        the last good checkpoint (checkpoints are only written after a finite window)."""
        local = torch.stack(self._losses).float()
        local = local.reshape(len(local), -1)[:, 0]  # the total (several tasks: [1 + T] a step)
        bad = torch.nonzero(~torch.isfinite(local)).flatten()
        first = self._step - len(local) + 1 + (int(bad[0]) if len(bad) else 0)
        param = next((n for n, p in self._model.named_parameters() if not torch.isfinite(p).all()), None)
        good = latest_checkpoint(self.run_dir)
        raise FloatingPointError(
            f"non-finite training loss at step {first} (steps {self._step - len(local) + 1}-{self._step} checked "
            f"together); first non-finite parameter: {param or 'none (the loss itself overflowed)'}; "
            f"last good checkpoint: {good or 'none'}. Lower train.embedding_lr / train.dense_lr"
            + (", then continue with --resume auto." if good else " and start again.")
        )

    def _log_train(self) -> None:
        """Global mean loss and samples/s since the last train line; one all_reduce."""
        elapsed = time.perf_counter() - self._t0
        # rows with weight > 0, not the sum of their sample weights
        real = (torch.cat(self._real_rows) > 0).float().sum()
        # Each step's logged loss: a scalar, or [1 + T] with several tasks (total, then per task).
        means = torch.stack(self._losses).float().mean(dim=0).reshape(-1)
        stats = torch.cat([means, real.reshape(1)]).cpu()
        if self._ctx.world_size > 1:
            dist.all_reduce(stats)
        loss, rows = float(stats[0]) / self._ctx.world_size, int(stats[-1])
        if not math.isfinite(loss):  # identical on every rank (all-reduced), so all stop here
            self._diverged()
        per_task = {}
        if len(means) > 1:
            names, _ = self._job.tasks
            per_task = {f"loss/{n}": float(v) / self._ctx.world_size for n, v in zip(names, stats[1:-1])}
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


def train(
    cfg: RunConfig | Job,
    run_dir: Path,
    profile_dir: Path | None = None,
    resume: Path | str | None = None,
    resume_on_new_data: bool = False,
) -> dict:
    """Train and evaluate as configured; returns the summary (also in summary.json).

    :meth:`Trainer.fit` in a ``with`` block: the process group is destroyed at the end if
    this call created it. ``profile_dir``, ``resume`` and ``resume_on_new_data`` as for :class:`Trainer`.
    """
    with Trainer(
        cfg, run_dir, resume=resume, profile_dir=profile_dir, resume_on_new_data=resume_on_new_data
    ) as trainer:
        return trainer.fit()
