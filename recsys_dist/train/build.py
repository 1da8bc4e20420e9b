"""What a rank builds from the resolved :class:`~recsys_dist.train.job.Job`: the three splits'
loaders and the sharded model with its optimizer; and the checks of the Trainer's arguments
that choose them (a model, a dense optimizer, an LR scheduler)."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer

from recsys_dist.data.convert import PreparedData
from recsys_dist.data.loader import LoaderOptions, ParquetBatchLoader
from recsys_dist.data.prefetch import auto_prefetch
from recsys_dist.data.resolve import prepare_from_config
from recsys_dist.data.spec import FeatureSpec
from recsys_dist.distributed import replicas
from recsys_dist.distributed.dense import dense_wrapper
from recsys_dist.distributed.env import DistContext, broadcast_result, under_launcher
from recsys_dist.distributed.optim import build_optimizer, fuse_embedding_optimizer
from recsys_dist.distributed.plan import Stats, World, plan, pooling_factors
from recsys_dist.distributed.plan_io import plan_summary
from recsys_dist.distributed.sharders import fix_replicated_sequence_tables, model_tables, sharders
from recsys_dist.distributed.tables import init_tables
from recsys_dist.files import write_atomic
from recsys_dist.models.build import build_model
from recsys_dist.models.managed import ManagedRemap, build_remap
from recsys_dist.models.registry import ModelSpec, get_model
from recsys_dist.models.task import CTRTask
from recsys_dist.section import ConfigError
from recsys_dist.train.early_stopping import BestTracker
from recsys_dist.train.job import Job
from recsys_dist.train.observe import PhaseClock

# Trainer(model=...): the run's FeatureSpec -> the model; Trainer(dense_optimizer=...): the dense
# parameters -> their optimizer; Trainer(lr_scheduler=...): that optimizer -> its scheduler.
ModelFactory = Callable[[FeatureSpec], nn.Module]
DenseOptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LRSchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass
class Loaders:
    """The three splits' loaders, and the table sizes the data preparation decided."""

    train: ParquetBatchLoader
    validation: ParquetBatchLoader
    test: ParquetBatchLoader
    num_embeddings: list[int]
    conversion: Path | None = None  # the cache entry the splits were converted into
    prepared: PreparedData | None = None  # the conversion the splits come from
    job: Job | None = None  # the job over that conversion (its table sizes): ``job.with_data(prepared)``


def make_loaders(job: Job, ctx: DistContext) -> Loaders:
    """Open every split on every rank: the data ``job.prepared`` converted (the launcher's), or
    converted here once (rank 0) when the job's data is not converted yet.

    ``job``: the resolved run. ``num_embeddings``: the table sizes the conversion decided (under
    vocabulary mapping the vocabulary's, built on train).
    """
    d = job.data
    prepared = job.prepared or broadcast_result(ctx, lambda: prepare_from_config(d, fmt=job.fmt))
    job = job.with_data(prepared)  # once: the caller takes it back as ``Loaders.job``
    features = job.features
    sizes = job.table_sizes
    dense_names, sparse_names = features.dense_names, features.keys
    options = LoaderOptions(
        num_embeddings=features.id_bounds,
        shuffle_buffer_rows=d.shuffle_buffer_rows,
        prefetch=d.prefetch
        if d.prefetch is not None
        else auto_prefetch(ctx.device.type, ctx.local_world_size, torch.get_num_threads()),
        pin_memory=ctx.device.type == "cuda",
        rank_reads=d.rank_reads,
        label_columns=features.label_columns,
        weight_column=features.weight_column,
    )
    training = replace(options, shuffle=d.shuffle, seed=job.train.seed, remainder=d.remainder)
    # Evaluation applies no loss_scale (and a weighted one would re-read every rank's weights).
    evaluation = replace(options, remainder="pad", scale_losses=False)
    eval_bs = job.eval.batch_size or job.train.batch_size
    at = (ctx.rank, ctx.world_size, dense_names, sparse_names)
    return Loaders(
        train=ParquetBatchLoader(prepared.paths("train"), job.train.batch_size, *at, training),
        validation=ParquetBatchLoader(prepared.paths("validation"), eval_bs, *at, evaluation),
        test=ParquetBatchLoader(prepared.paths("test"), eval_bs, *at, evaluation),
        num_embeddings=sizes,
        conversion=prepared.directory,
        prepared=prepared,
        job=job,
    )


def managed_remap(job: Job, features: FeatureSpec, world_size: int | None = None) -> ManagedRemap | None:
    """The managed-collision remap of ``features.managed`` (None when there is none), on
    ``features.device``: its history holds ``data.managed.eviction_interval`` global batches of
    ``train.batch_size`` x ``world_size`` rows (default ``distributed.nproc_per_node``)."""
    if not features.managed:
        return None
    ranks = world_size if world_size is not None else job.distributed.nproc_per_node
    return build_remap(job.data.managed, features, job.train.batch_size * ranks, job.data.multi_hot_sizes)


def build_task(
    job: Job, features: FeatureSpec, world_size: int | None = None, module: nn.Module | ModelFactory | None = None
) -> CTRTask:
    """The job's model over ``features`` (on their devices) with its loss and managed remap
    (:func:`managed_remap`): ``build_model(job.model, features, job.train, remap=...)``;
    ``module``: ``Trainer(model=...)``."""
    remap = managed_remap(job, features, world_size)
    return build_model(job.model, features, job.train, remap=remap, module=module)


def plan_job(job: Job, model: nn.Module, world: World, stats: list[Stats] | None = None) -> ShardingPlan:
    """:func:`recsys_dist.distributed.plan.plan` for the job: its ``sharding`` section, the
    planner's batch size (``sharding.planner_batch_size``, else ``train.batch_size``) and
    ``data.multi_hot_sizes``; problems of the config raise ConfigError. The Trainer's and the
    dry run's call."""
    return plan(
        model,
        job.sharding,
        world,
        job.sharding.planner_batch_size or job.train.batch_size,
        pooling_factors(model_tables(model), job.data.multi_hot_sizes),
        stats=stats,
        config_error=True,
    )


def shard_model(
    job: Job,
    ctx: DistContext,
    spec: FeatureSpec | None = None,
    clock: PhaseClock | None = None,
    module: nn.Module | ModelFactory | None = None,
    dense_factory: DenseOptimizerFactory | None = None,
) -> tuple[DistributedModelParallel, CombinedOptimizer, str]:
    """Build on meta, fuse the embedding optimizer into backward, plan, wrap in DMP.

    ``job``: the resolved run. ``spec``: the run's
    FeatureSpec (default ``job.features``, with the rank's device). Every EmbeddingBagCollection table of the built model is planned and
    initialised, whether the spec or the model's own code made it. ``clock``: the planning
    counts as its ``plan`` phase, sharding and initialising the tables as ``tables``.
    ``module`` / ``dense_factory``: ``Trainer(model=..., dense_optimizer=...)``.
    """

    def phase(name: str):
        return clock.phase(name) if clock is not None else nullcontext()

    spec = spec or job.features.on(torch.device("meta"), ctx.device)
    with phase("plan"):
        model = build_task(job, spec.on(torch.device("meta"), ctx.device), ctx.world_size, module)
        fuse_embedding_optimizer(
            model, job.train.embedding_optimizer, job.train.embedding_lr, job.train.embedding_weight_decay
        )
        tables = model_tables(model)
        found = plan_job(job, model, World(ctx.world_size, ctx.local_world_size, ctx.device.type, dist.group.WORLD))
    with phase("tables"):
        return _wrap_and_init(job, ctx, model, tables, found, dense_factory)


def _wrap_and_init(job: Job, ctx: DistContext, model, tables, plan, dense_factory=None):
    dmp = replicas.wrap(  # DistributedModelParallel, or ReplicaDMP under sharding.replica_groups
        model,
        ctx.device,
        plan,
        job.sharding,
        sharders=sharders(job.sharding.comms, ctx.device.type),
        data_parallel_wrapper=dense_wrapper(job.distributed.dense.strategy, ctx.world_size, job.distributed.dense),
    )
    fix_replicated_sequence_tables(dmp)
    init_tables(dmp.state_dict(), tables, job.train.seed, {t.name: t.weight_init_max for t in tables})
    t = job.train
    optimizer = build_optimizer(
        dmp,
        t.embedding_optimizer,
        t.embedding_lr,
        t.dense_optimizer,
        t.dense_lr,
        t.dense_grad_clip_norm,
        t.embedding_weight_decay,
        dense_factory=dense_factory,
    )
    return dmp, optimizer, str(plan)


def model_for_run(
    job: Job,
    ctx: DistContext,
    loaders: Loaders,
    clock: PhaseClock,
    module: nn.Module | ModelFactory | None = None,
    dense_factory: DenseOptimizerFactory | None = None,
) -> tuple[FeatureSpec, ModelSpec, Any, DistributedModelParallel, CombinedOptimizer, str]:
    """The Trainer's model: its ``FeatureSpec`` on ``meta`` (given the model's own data: its
    ``read_data`` hook, called once on rank 0 with the split files, then ``on_data``), the
    registered ``ModelSpec`` (hooks), that data, the sharded model, its optimizer and the plan as
    text (:func:`shard_model`)."""
    spec = job.features.on(torch.device("meta"), ctx.device)
    # The model's own data (two_tower: the item corpus and evaluated users), read once on
    # rank 0, then its FeatureSpec given that data (two_tower: the logQ item counts).
    hooks = job.model_spec or get_model(job.model.name)
    data = None
    if hooks.read_data is not None:
        read = hooks.read_data
        paths = {s: [str(f) for f in getattr(loaders, s).files] for s in ("train", "validation", "test")}
        data = broadcast_result(ctx, lambda: read(job, paths))
    if hooks.on_data is not None:
        spec = hooks.on_data(spec, data)
    model, optimizer, plan_text = shard_model(job, ctx, spec, clock, module, dense_factory)
    return spec, hooks, data, model, optimizer, plan_text


def check_given_once(job: Job, model, dense_optimizer, lr_scheduler) -> None:
    """Refuse an option given both in the config and as a Trainer argument (one of the two would
    be ignored).

    Raises:
        ConfigError: naming the config keys and the argument.
        TypeError: an argument that is not callable.
    """
    problems = []
    for arg, given, section, keys in (
        ("model", model, job.model, None),
        ("dense_optimizer", dense_optimizer, job.train, ("dense_optimizer", "dense_lr")),
        ("lr_scheduler", lr_scheduler, job.train, ("warmup_steps", "decay_start_step", "decay_steps")),
    ):
        if given is None:
            continue
        if not callable(given):
            raise TypeError(f"Trainer({arg}=...) must be callable, got {type(given).__name__}")
        prefix = "model" if section is job.model else "train"
        both = sorted(
            k
            for k in section.model_fields_set
            if (k not in ("embedding_dim", "embedding_init_scale") if keys is None else k in keys)
        )
        if both:
            problems.append(
                f"{', '.join(f'{prefix}.{k}' for k in both)} in the config and Trainer({arg}=...) both choose the "
                f"{'model' if keys is None else arg.replace('_', ' ')}; remove {'them' if len(both) > 1 else 'it'} "
                f"from the config or leave out {arg}="
            )
    if problems:
        raise ConfigError("an option is given twice:\n  " + "\n  ".join(problems))


def check_callbacks(job: Job, callbacks, callback_type: type) -> None:
    """The Trainer's ``callbacks``: each a ``callback_type`` (``recsys_dist.Callback``), and the
    publishing one among them when ``publish.enabled``.

    Raises:
        TypeError: a callback of another type. ConfigError: ``publish.enabled`` without one that publishes.
    """
    for cb in callbacks:
        if not isinstance(cb, callback_type):
            raise TypeError(f"callbacks must be recsys_dist.Callback objects, got {type(cb).__name__}")
    if job.publish.enabled and not any(getattr(cb, "publishes", False) for cb in callbacks):
        raise ConfigError(
            "publish.enabled: the Trainer publishes through its callback: pass "
            "callbacks=[recsys_dist.serve.publish_callback.PublishCallback(job.publish, run_dir)] "
            "(recsys-dist train adds it), or set publish.enabled: false"
        )


def check_lr_scheduler(scheduler):
    """What ``Trainer(lr_scheduler=...)`` made, if the Trainer can step it: a step-count
    ``LRScheduler`` (stepped with no argument after every step, that count replayed on resume).

    Raises:
        TypeError: not an ``LRScheduler`` (e.g. None), or a ``ReduceLROnPlateau`` (it steps
            on a metric: it failed at the first step, after the data and sharding).
    """
    if isinstance(scheduler, ReduceLROnPlateau):
        raise TypeError(
            "Trainer(lr_scheduler=...) made a ReduceLROnPlateau, which steps on a validation metric; the "
            "Trainer steps its scheduler after every training step with no argument (and replays that count on "
            "resume). Use a step-count schedule (LambdaLR, StepLR, CosineAnnealingLR, ...), or lower the rate "
            "yourself in a Callback's on_validation_end"
        )
    if not isinstance(scheduler, LRScheduler):
        raise TypeError(
            "Trainer(lr_scheduler=...) must return a torch.optim.lr_scheduler.LRScheduler over the optimizer it "
            f"is given, got {type(scheduler).__name__}"
        )
    return scheduler


def require_ranks(job: Job) -> None:
    """Refuse to train one rank of a job configured for several: a single process with
    neither a launcher nor a process group and ``distributed.nproc_per_node`` > 1.

    Raises:
        ConfigError: saying how to start the ranks.
    """
    n = job.distributed.nproc_per_node
    if n > 1 and not dist.is_initialized() and not under_launcher():
        raise ConfigError(
            f"distributed.nproc_per_node is {n}, but this is a single process with no launcher and no "
            f"process group: the Trainer would train only one rank of {n}. Start {n} ranks instead: "
            f"recsys_dist.launch(fn, {n}) with fn a module-level function that builds and fits the Trainer, "
            f"torchrun --nproc_per_node={n} your_script.py, or recsys-dist train --config CONFIG; "
            "or set distributed.nproc_per_node=1 to train on one rank"
        )


def write_plan(run_dir: Path, plan, spec: FeatureSpec, plan_text: str) -> None:
    """``plan.txt`` (TorchRec's plan as text) and ``plan.json`` (one row per table shard) of a run."""
    write_atomic(run_dir / "plan.txt", plan_text + "\n")
    write_atomic(run_dir / "plan.json", json.dumps(plan_summary(plan, spec.planned_tables()), indent=2))


def best_tracker(job: Job, steps_per_epoch: int = 1, global_batch: int = 1) -> BestTracker | None:
    """The tracker of ``train.early_stopping`` (or of validation AUC for ``checkpoint.keep_best``).

    ``steps_per_epoch`` (steps of the training split) and ``global_batch`` (training rows a
    step over all ranks) turn a patience in epochs or rows into steps."""
    es = job.train.early_stopping
    if es is not None:
        steps = None
        if es.patience_unit == "epochs":
            steps = es.patience * max(steps_per_epoch, 1)
        elif es.patience_unit == "rows":
            steps = -(-es.patience // max(global_batch, 1))  # ceil: at least this many rows
        return BestTracker(es.metric, es.patience, es.min_delta, patience_steps=steps)
    return BestTracker("auc") if job.checkpoint.keep_best else None


def keeps_best(job: Job) -> bool:
    """Whether a run saves a checkpoint at each new best and keeps it as ``checkpoints/best``:
    ``checkpoint.keep_best``, or early stopping that restores the best weights (they are read
    back from that checkpoint), with checkpoints on."""
    es = job.train.early_stopping
    return job.checkpoint.enabled and (job.checkpoint.keep_best or (es is not None and es.restore_best))
