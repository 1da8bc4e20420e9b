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

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.dcp import save_checkpoint
from recsys_dist.checkpoint.meta import read_meta
from recsys_dist.config.base import ConfigError
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.distributed.env import (
    DistContext,
    broadcast_result,
    check_reusable,
    init_distributed,
    note_failure,
)
from recsys_dist.distributed.optim import dense_torch_optimizer
from recsys_dist.distributed.plan_io import plan_summary
from recsys_dist.distributed.rules import comms_problems
from recsys_dist.models.managed import managed_metrics
from recsys_dist.models.registry import get_model
from recsys_dist.train.best_weights import MemoryCopy
from recsys_dist.train.build import (
    DenseOptimizerFactory,
    Loaders,
    LRSchedulerFactory,
    ModelFactory,
    best_tracker,
    check_callbacks,
    check_given_once,
    check_lr_scheduler,
    make_loaders,
    progress_bar,
    require_ranks,
    shard_model,
    write_plan,
)
from recsys_dist.train.evaluation import evaluate, predict
from recsys_dist.train.job import Job
from recsys_dist.train.loop import TrainLoop
from recsys_dist.train.metrics_writer import MetricsWriter
from recsys_dist.train.observe import PhaseClock, TraceWriter
from recsys_dist.train.pipelines import TrainPipeline, pipeline_problems
from recsys_dist.train.results import FitSummary
from recsys_dist.train.schedule import LRSchedule
from recsys_dist.train.summary import ledger_line

log = logging.getLogger("recsys_dist")
# A hook's trainer: Any, so that a user's hook may annotate the public recsys_dist.Trainer (a subclass)
HookTrainer = Any
_TRAINERS_MADE = 0  # a process's first Trainer counts its startup from the process's start


class Callback:
    """Hooks the :class:`Trainer` calls (``Trainer(callbacks=[...])``: subclass it and override what you need) on every rank, in the order of its
    ``callbacks`` list. They run inside the training loop: a collective in one must run on every
    rank (the Trainer calls each hook on every rank at the same point); an exception stops the run."""

    def on_step_end(self, trainer: HookTrainer, step: int, loss: torch.Tensor) -> None:
        """After optimizer step ``step`` (global, from 1; ``trainer.step`` equals it).

        ``loss``: this rank's training loss of the step, detached, times the batch's
        ``loss_scale`` (float32 scalar; ``[1 + T]`` with several tasks: the total, then each
        task's). Reading its value (``float(loss)``) waits for the step to finish; the
        global mean is in ``metrics.jsonl`` every ``train.log_every_n_steps``."""

    def on_validation_end(self, trainer: HookTrainer, step: int, metrics: dict[str, float]) -> None:
        """After each validation (every epoch's end and every ``eval.every_n_steps``), with the
        global metrics written to ``metrics.jsonl`` (the same dict on every rank)."""

    def on_checkpoint(self, trainer: HookTrainer, step: int, path: Path) -> None:
        """After the checkpoint of ``step`` was written, complete, to ``path`` (on every rank)."""

    def on_resume(self, trainer: HookTrainer, step: int, checkpoint: Path) -> None:
        """At ``fit``'s start in a run resumed from ``checkpoint`` (to finish what a kill cut short)."""

    def on_partition_end(self, trainer: HookTrainer, partition: str, checkpoint: Path | None) -> None:
        """A ``StreamTrainer`` trained ``partition``, then saved ``checkpoint`` (None: checkpoints off)."""


class Trainer(TrainLoop):
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
        self._callbacks = list(callbacks)
        self._lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._resume_on_new_data = resume_on_new_data
        self._owns_group = not dist.is_initialized()
        self._closed = self._failed = False
        self._bar = self._writer = self._tracer = self._lock = None
        self._ctx = init_distributed(job.distributed)
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
        job, ctx = self.job, self._ctx
        # Before the run directory is taken: a pipeline this device cannot run was refused only
        # at fit(), after config.yaml, the plan and the ledger line had been written there.
        problems = pipeline_problems(job.train.pipeline, ctx.device.type)
        problems += comms_problems(job.sharding.comms, ctx.device.type, ctx.world_size)
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
        self._take_run_dir()
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
        self._setup_data(checkpoint)
        self._setup_model()
        self._setup_loop(checkpoint, profile_dir)
        if checkpoint is not None:
            with self._clock.phase("checkpoint"):
                self._restore(checkpoint)
                self._replay_lr_scheduler()
            self.resumed_at_step = self._step
        self._start_metrics()

    def _setup_data(self, checkpoint: Path | None) -> None:
        """The loaders, the training data's identity and where the run starts and ends."""
        job, ctx = self.job, self._ctx
        if job.data.stream is not None:
            raise ConfigError(
                "data.stream: a run over landing partitions is a recsys_dist.StreamTrainer (recsys-dist train "
                "picks it); the Trainer trains epochs over data.raw_path"
            )
        with self._clock.phase("data"):
            self._loaders = make_loaders(self.job, ctx)  # converts the data; decides the table sizes
        self.job = self.job.with_data(self._loaders.prepared)
        # The training split's identity, recorded in each checkpoint; a resume on another one
        # is refused unless resume_on_new_data (then its epoch starts again: resume_position).
        conversion = self._loaders.conversion
        self._data = broadcast_result(
            ctx, lambda: run_dirs.data_identity(conversion, job.data.raw_path) if conversion is not None else None
        )
        meta = read_meta(checkpoint) if checkpoint is not None else None
        flag = "resume_on_new_data=True (on the command line --resume-on-new-data)"
        self._new_data = meta is not None and run_dirs.check_same_data(
            checkpoint, meta, self._data, self._resume_on_new_data, flag
        )
        per_epoch = len(self._loaders.train)
        self._global_batch = job.train.batch_size * ctx.world_size  # a checkpoint's position is in its own
        self._resume_epoch, self._step_offset = (
            run_dirs.resume_position(meta, per_epoch, self._new_data, self._global_batch)
            if meta is not None
            else (0, 0)
        )
        self.total_steps = run_dirs.total_steps(job.train, per_epoch, self._step_offset)
        # A resumed run replaces config.yaml only when there is something left to train.
        done = checkpoint is not None and run_dirs.checkpoint_step(checkpoint) >= self.total_steps
        broadcast_result(ctx, lambda: run_dirs.write_config(job.to_dict(), self.run_dir, write=not done))
        log.info(
            "data ready: %d train / %d validation / %d test rows, %d steps per epoch",
            self._loaders.train.num_rows,
            self._loaders.validation.num_rows,
            self._loaders.test.num_rows,
            len(self._loaders.train),
        )

    def _setup_model(self) -> None:
        """The sharded model and its optimizer (and a user LR scheduler); plan.txt / plan.json."""
        job, ctx = self.job, self._ctx
        self.spec = self.job.features.on(torch.device("meta"), ctx.device)
        # The model's own data (two_tower: the item corpus and evaluated users), read once on
        # rank 0, then its FeatureSpec given that data (two_tower: the logQ item counts).
        self._model_hooks = self.job.model_spec or get_model(job.model.name)
        self._model_data = None
        if self._model_hooks.read_data is not None:
            loaders, read = self._loaders, self._model_hooks.read_data
            paths = {s: [str(f) for f in getattr(loaders, s).files] for s in ("train", "validation", "test")}
            self._model_data = broadcast_result(ctx, lambda: read(job, paths))
        if self._model_hooks.on_data is not None:
            self.spec = self._model_hooks.on_data(self.spec, self._model_data)
        self._model, self._optimizer, plan_text = shard_model(
            self.job, ctx, self.spec, self._clock, self._user_model, self._dense_factory
        )
        if self._scheduler_factory is not None:
            self._lr_scheduler = check_lr_scheduler(self._scheduler_factory(dense_torch_optimizer(self._optimizer)))
        log.info("sharded: %s", ", ".join(sorted({r["sharding_type"] for r in plan_summary(self._model.plan)})))
        if ctx.is_main:
            write_plan(self.run_dir, self._model.plan, self.spec, plan_text)

    def _setup_loop(self, checkpoint: Path | None, profile_dir: Path | None) -> None:
        """The training loop's state at step 0 (a resume then restores it), its writers and bar."""
        job, ctx = self.job, self._ctx
        resume_step = run_dirs.checkpoint_step(checkpoint) if checkpoint is not None else None
        self._writer = MetricsWriter(self.run_dir / "metrics.jsonl", ctx.is_main, ctx.world_size, resume_step)
        self._tracer = TraceWriter(profile_dir, ctx.rank)
        t = job.train
        self._schedule = LRSchedule(t.warmup_steps, t.decay_start_step, t.decay_steps)
        self._base_lrs = [g["lr"] for g in self._optimizer.param_groups]
        self._pipe: TrainPipeline | None = None
        self._pipe_drained = False  # the last epoch's pipeline ran its iterator dry (it may be reused)
        self._step = self.epoch = self.rows_trained = 0
        self._next_epoch = self._first_epoch = self._in_epoch = 0
        self.train_seconds = 0.0
        self._losses: list = []
        self._real_rows: list = []
        self._window_seconds = 0.0  # seconds of the logging window before a resume (a stream's)
        self._early_batches = None  # the next epoch's batches, opened during this epoch's validation
        self._last_val: tuple[int, dict] | None = None  # (step, metrics) of the latest validation
        self._saved_step: int | None = None  # the step of the checkpoint written last
        self._saved_path: Path | None = None  # and its directory
        self._weights_step: int | None = None  # restore_best: the step of the weights held, if not the last
        self._stale_line = None  # metrics lines of the resumed step to write again (StreamTrainer)
        per_epoch = len(self._loaders.train) if self._loaders.train is not None else 1  # a stream: no epochs
        self.best = best_tracker(job, per_epoch, self._global_batch)
        es = t.early_stopping  # restore_best without checkpoints: the best weights kept in memory
        self._memory_best = MemoryCopy() if es and es.restore_best and not job.checkpoint.enabled else None
        self._t0 = time.perf_counter()
        self._bar = progress_bar(self.total_steps, ctx.is_main and t.progress_bar)
        self.resumed_from = checkpoint
        self.resumed_at_step = None

    def _start_metrics(self) -> None:
        ctx = self._ctx
        # Lines past the step this run starts from (all of them when it starts from scratch)
        # are written again: each (split, step) once, whatever restarted the run.
        broadcast_result(ctx, lambda: self._writer.start(self._step, self._stale_line))
        # The bytes one step moves (recsys_dist.distributed.ledger): written when it differs from the
        # run's last ledger line (a first start, or a resume on another plan or world size),
        # so a resumed run leaves the same lines as an uninterrupted one.
        ledger = ledger_line(self.job, self._model, ctx.world_size)

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
    def clock(self) -> PhaseClock:
        """This rank's wall-time split (``wall_split``); ``trainer.clock.phase("publish")`` times a callback's work."""
        return self._clock

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (global: the same on every rank)."""
        return self._step

    # ------------------------------------------------------------------ the job

    def fit(self) -> FitSummary:
        """Train ``train.epochs`` epochs (capped by ``train.max_steps``, and stopped early by
        ``train.early_stopping``), scoring the validation split after each one (and every
        ``eval.every_n_steps``; once at a step that is both), put back the best validation
        weights (``train.early_stopping.restore_best``, the default with early stopping), then
        score the test split, save the final checkpoint (when ``checkpoint.enabled``; it holds
        the weights scored, at the last step's position) and write ``summary.json``.
        Collective: every rank must call it.

        Returns:
            The summary, as in ``summary.json``: ``run_dir``, ``world_size``, ``steps``,
            ``weights_step`` (the step whose weights ``validation`` and ``test`` are of),
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
            for callback in self._callbacks if self.resumed_from is not None else ():
                callback.on_resume(self, self._step, self.resumed_from)
            while self._next_epoch < self.job.train.epochs and not self._done():
                last_val = self.train_epoch() or last_val
            self._tracer.close()
            self._bar.close()
            weights_step, last_val = self._restore_best(last_val)  # train.early_stopping.restore_best
            test = self.evaluate("test")
            managed = managed_metrics(self._model, "test")
            # step: the training position; weights_step: whose weights were scored (restore_best).
            self._writer.write(
                split="test", step=self._step, weights_step=weights_step, epoch=self.epoch, **test, **managed
            )
            checkpoint = self.save_checkpoint() if self.job.checkpoint.enabled else None
            return self._write_summary(last_val, test, checkpoint, weights_step)

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
        with self._collective(), self._clock.phase("eval"):
            self._detach_pipeline()
            c = self.job.eval
            names, kinds = self.job.features.tasks, self.job.features.task_kinds
            metrics = evaluate(
                self._model,
                self._loader(split),
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
            meta = self._checkpoint_meta()
            c = self.job.checkpoint
            path = save_checkpoint(self._ctx, self.run_dir, self._step, self._state(), meta, c.keep, best=best)
            self._saved_step, self._saved_path = self._step, path
            if self._ctx.is_main:
                self._pin_preprocessing(path)
        for callback in self._callbacks:
            callback.on_checkpoint(self, self._step, path)
        return path

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

    def __enter__(self) -> Self:  # a StreamTrainer's is a StreamTrainer
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._failed = True
        self.close()
