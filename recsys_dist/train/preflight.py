"""Checks across config sections, and checks of the machine and files before any rank starts.

The one module that sees every section, run once on the resolved :class:`Job`: by the
launcher (:func:`check_before_launch`, before the run directory is taken and any rank
starts), or by the Trainer for a config it is given directly (:func:`check_sections`).
``RunConfig`` validation (``load_config``) checks each section on its own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from recsys_dist.checkpoint.compat import check_compatible
from recsys_dist.checkpoint.meta import read_meta
from recsys_dist.checkpoint.run_dir import check_stream_resume
from recsys_dist.data.config import missing_data_files
from recsys_dist.distributed.config import CUDA_ONLY_KERNELS
from recsys_dist.distributed.rules import (
    comms_problems,
    fixed_plan_problems,
    per_table_problems,
    pipeline_cut_problems,
    pipeline_layout_problems,
    replica_problems,
    small_table_problems,
    unpooled_type_problems,
)
from recsys_dist.distributed.sharders import check_covered
from recsys_dist.distributed.stages import cut_model
from recsys_dist.models.build import build_model
from recsys_dist.models.registry import GIVEN_MODEL, get_model
from recsys_dist.section import ConfigError
from recsys_dist.train.batch_memory import batch_memory_problems, local_rank_count
from recsys_dist.train.job import Job
from recsys_dist.train.pipelines import pipeline_problems
from recsys_dist.train.section_checks import Sections, config_problems


def check_sections(job: Job) -> None:
    """:func:`section_problems` as one error (what the Trainer runs on a config it is given).

    Raises:
        ConfigError: "invalid config:" and every problem, one a line.
    """
    problems = section_problems(job)
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))


def section_problems(job: Job) -> list[str]:
    """Problems that involve two sections (each as "dotted.key: what is wrong; the fix").

    ``job``: the resolved run, whose sections are each valid on their own.
    """
    problems = []
    spec = job.model_spec or get_model(job.model.name)
    problems += spec.problems(job)  # the model's own (registered checks: dense needed, one task, ...)
    # what the config alone decides (preprocess runs these too)
    problems += config_problems(Sections(job.data, job.train, job.eval, job.checkpoint, job.publish, job.fmt))
    seq = list(job.features.sequence_names)
    # s_<feature>: how models.build names the sequence tables (EmbeddingCollection)
    problems += unpooled_type_problems(job.sharding, [f"s_{n}" for n in seq])
    if spec.evaluator is None and job.eval.retrieval_k is not None:
        problems.append(f"eval.retrieval_k: {spec.name} is not a retrieval model (two_tower); remove it")
    if job.data.stream is not None and spec.read_data is not None:
        problems.append(
            f"model.name: {job.model.name} reads its own data from the training splits (an item corpus), which a "
            "stream does not have; use a CTR model with data.stream"
        )
    d = job.distributed
    problems += replica_problems(
        job.sharding,
        job.world.size,
        d.dense,
        job.train.embedding_optimizer,
        job.train.pipeline,
        bool(job.features.managed),
    )
    return problems + dense_problems(job)


# train keys that a pipeline step does not apply (it is its own loop: no TorchRec train pipeline,
# no stage timer, per-stage gradients that a global clip norm would need gathered, fp32 stages).
_NOT_UNDER_PIPELINE = {
    "pipeline": "TorchRec's train pipelines do not run the stages; the step runs in train.pipeline: base's order",
    "timing_every_n_steps": "the stage times are TorchRec pipeline stages'",
    "dense_grad_clip_norm": "each stage holds a part of the dense gradient, the norm would be a stage's",
    "precision": "the stages run in fp32",
}


def dense_problems(job: Job) -> list[str]:
    """``distributed.dense`` with the world, the batch, the model and the train keys: under
    strategy pipeline the layout (:func:`pipeline_layout_problems`), the model's cut (built on
    meta; :func:`pipeline_cut_problems`) and the train keys it does not apply."""
    d = job.distributed.dense
    if d.strategy != "pipeline":
        return []
    problems = pipeline_layout_problems(d, job.world.size, job.train.batch_size)
    problems += [
        f"train.{key}: not applied under distributed.dense.strategy: pipeline ({why}); remove it"
        for key, why in _NOT_UNDER_PIPELINE.items()
        if key in job.train.model_fields_set or getattr(job.train, key) != type(job.train).model_fields[key].default
    ]
    if job.features.managed:
        return [
            *problems,
            "distributed.dense.strategy: pipeline: managed-collision ids (data.categorical_mapping: "
            "managed) are not supported under pipeline stages; use strategy ddp or fsdp, or hashed ids",
        ]
    if job.model_spec not in (None, GIVEN_MODEL):  # a Trainer(model=...) model is checked as it is sharded
        try:
            model = build_model(job.model, job.features.on(torch.device("meta")), job.train)
        except Exception:  # noqa: BLE001 - the model's own problems are reported by its checks
            return problems
        tower, why = cut_model(model)
        problems += pipeline_cut_problems(d, None if tower is None else len(tower), why)
    return problems


def table_names(job: Job) -> list[str]:
    """Every table of the configured model, named as the model names them
    (``FeatureSpec.planned_tables``): ``t_<feature>``, ``w_<feature>`` for models registered
    with first-order tables, then ``s_<feature>`` for sequence features."""
    return [t.name for t in job.features.planned_tables()]


def coverage_problems(job: Job) -> list[str]:
    """Embedding modules of the configured model that no sharder covers (``sharding.check_covered``:
    a plain ``nn.Embedding`` / ``nn.EmbeddingBag`` would be replicated in full on every rank),
    found by building the model with its tables on the meta device, as the ranks do. A model
    that fails to build here is left to the ranks, which build it on their own device and
    report that failure."""
    try:
        model = (job.model_spec or get_model(job.model.name)).build(job.features, job.model)
    except Exception:  # noqa: BLE001 - not this check's to report (see the docstring)
        return []
    if not isinstance(model, torch.nn.Module):
        return []
    try:
        check_covered(model)
    except ValueError as err:
        return [f"model.name: {job.model.name}: {err}"]
    return []


def uvm_kernels(job: Job) -> list[tuple[str, str]]:
    """(config key, kernel) for every CUDA-only compute kernel the config allows."""
    found = [("sharding.compute_kernels", k) for k in job.sharding.compute_kernels if k in CUDA_ONLY_KERNELS]
    for name, t in job.sharding.per_table.items():
        found += [
            (f"sharding.per_table.{name}.compute_kernels", k) for k in t.compute_kernels if k in CUDA_ONLY_KERNELS
        ]
    return found


def _every_table_data_parallel(job: Job) -> bool:
    """Whether the config places every table data_parallel (by fixed_plan, or by
    sharding_types with per_table overrides that allow nothing else)."""
    s = job.sharding
    if s.fixed_plan is not None:
        return bool(s.fixed_plan) and all(fp.sharding_type == "data_parallel" for fp in s.fixed_plan.values())
    if s.sharding_types != ["data_parallel"]:
        return False
    return all(t.sharding_types in ([], None, ["data_parallel"]) for t in s.per_table.values())


def check_before_launch(job: Job, world_size: int | None = None, memory: bool = True) -> None:
    """Every check of a run before any rank is spawned: :func:`section_problems`, and those that
    need the filesystem or the machine; all problems in one error.

    ``job``: the resolved run. ``world_size`` is the job's
    size when known (under torchrun), else ``job.world.size``.
    ``memory``: check that one batch fits in the machine's memory
    (``recsys_dist.train.batch_memory``); off in a rank, whose peers are allocating meanwhile.

    Raises:
        ConfigError: the data file is missing, the device asked for is absent, the model holds
            an embedding module no sharder covers (:func:`coverage_problems`), ...
    """
    problems = []
    stream = job.data.stream
    if job.data.raw_path is None and stream is None:
        problems.append("  data.raw_path: not set; training needs a raw data file (or data.stream)")
    if stream is not None and not Path(stream.path).is_dir():
        problems.append(f"  data.stream.path: {stream.path} is not a directory (create it, or fix the path)")
    problems += [f"  {p}" for p in missing_data_files(job.data)]  # also for a config not from load_config
    problems += [f"  {p}" for p in section_problems(job)]
    problems += [f"  {p}" for p in coverage_problems(job)]
    world = world_size if world_size is not None else job.world.size
    if world % job.sharding.replica_groups == 0:  # tables are planned for one group (else refused above)
        world //= job.sharding.replica_groups
    problems += _table_problems(job, world)
    problems += _kernel_problems(job, world)
    if memory:
        problems += [f"  {p}" for p in batch_memory_problems(job, local_rank_count(job))]
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(problems))


def _table_problems(job: Job, world: int) -> list[str]:
    """The sharding section against the model's tables and the job's ``world`` size."""
    problems = []
    tables = table_names(job)
    problems += [f"  {p}" for p in per_table_problems(job.sharding, tables)]
    fixed = job.sharding.fixed_plan
    problems += [f"  {p}" for p in fixed_plan_problems(job.sharding, tables, world)]
    if job.sharding.sharding_types == ["table_wise"] and world > len(tables) and fixed is None:
        problems.append(
            f"  distributed.nproc_per_node: {world} ranks but only {len(tables)} tables and "
            "sharding_types [table_wise]; allow row_wise or column_wise, or use fewer ranks"
        )
    if job.data.categorical_mapping == "hash":  # vocabulary sizes are known once converted (checked then)
        problems += [f"  {p}" for p in _size_problems(job, world)]
    return problems


def _size_problems(job: Job, world: int) -> list[str]:
    """Tables of the job's sizes too small for the sharding types allowed over ``world`` ranks."""
    sizes = {t.name: t.num_embeddings for t in job.features.planned_tables()}
    return small_table_problems(job.sharding, sizes, world)


def check_converted(job: Job) -> None:
    """The table-size rules once the data is converted: under vocabulary or managed mapping the
    table sizes are known only then (hash-mapped sizes are checked before, by
    :func:`check_before_launch`). Run by the launcher before any rank starts.

    Raises:
        ConfigError: "invalid config:" and each table too small for the sharding types allowed.
    """
    if job.data.categorical_mapping == "hash":
        return
    problems = _size_problems(job, job.world.size)
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))


def _kernel_problems(job: Job, world: int) -> list[str]:
    """Kernels, comms, optimizers and pipelines against the device they would run on."""
    problems = []
    only_dp = _every_table_data_parallel(job)
    comms = job.sharding.comms
    if (comms.forward, comms.backward) != ("fp32", "fp32") and only_dp:
        problems.append(
            "  sharding.comms: every table is data_parallel, which has no output_dist to quantize (its "
            "gradients go through DDP's fp32 all-reduce); remove sharding.comms or allow a sharded type"
        )
    if job.model.embedding_dim % 4 and not only_dp:
        low = job.model.embedding_dim - job.model.embedding_dim % 4
        problems.append(
            f"  model.embedding_dim: {job.model.embedding_dim} is not a multiple of 4, which FBGEMM's fused "
            f"kernel needs for every local shard; use {low or 4} or {low + 4} (or sharding_types: [data_parallel])"
        )
    for key, types, kernels in [("sharding", job.sharding.sharding_types, job.sharding.compute_kernels)] + [
        (
            f"sharding.per_table.{n}",
            t.sharding_types or job.sharding.sharding_types,
            t.compute_kernels or job.sharding.compute_kernels,
        )
        for n, t in job.sharding.per_table.items()
    ]:
        if types == ["data_parallel"] and kernels and "dense" not in kernels:
            problems.append(f"  {key}.compute_kernels: data_parallel tables need the dense kernel; add dense")
        if types and "data_parallel" not in types and kernels == ["dense"]:
            problems.append(f"  {key}.compute_kernels: only data_parallel uses the dense kernel; add fused")
    cuda = torch.cuda.is_available()
    if job.distributed.device == "cuda" and not cuda:
        problems.append("  distributed.device: 'cuda' asked for but no CUDA device is visible (use auto or cpu)")
    cpu = job.distributed.device == "cpu" or not cuda
    problems += [f"  {p}" for p in comms_problems(comms, "cpu" if cpu else "cuda", world, job.sharding.replica_groups)]
    if cpu:
        if job.train.embedding_optimizer == "adam" and job.sharding.sharding_types != ["data_parallel"]:
            problems.append(
                "  train.embedding_optimizer: FBGEMM's CPU kernels have no Adam for sharded tables; use "
                "exact_rowwise_adagrad, exact_adagrad or exact_sgd on CPU (or sharding.sharding_types: [data_parallel])"
            )
        if job.train.embedding_weight_decay and not only_dp:
            problems.append(
                f"  train.embedding_weight_decay: {job.train.embedding_weight_decay} would be ignored: FBGEMM's "
                "CPU fused kernel has no weight decay for sharded tables; set it to 0, or train on CUDA (or "
                "sharding.sharding_types: [data_parallel])"
            )
        problems += [f"  {key}: {k} needs a CUDA device; use fused on CPU" for key, k in uvm_kernels(job)]
        problems += [f"  {p}" for p in pipeline_problems(job.train.pipeline, "cpu")]
    return problems


def check_resumable(job: Job, checkpoint: Path, world_size: int | None = None) -> None:
    """Refuse a checkpoint written by another model config (before any rank starts).

    Table sizes are compared only when they come from the config (hash mapping); sizes
    from a vocabulary are known once the data is converted. ``world_size``: the resumed
    job's ranks (default ``job.world.size``), for the global batch that managed tables keep.

    Raises:
        CheckpointError: naming each differing key, old -> new; a checkpoint of a run over
            ``data.stream`` resumed by one over ``data.raw_path``, or the reverse.
    """
    meta = read_meta(checkpoint)
    ranks = world_size if world_size is not None else job.world.size
    check_stream_resume(checkpoint, meta, job.data.stream is not None, job.train.batch_size * ranks)
    tables = job.data.categorical_mapping == "hash"
    check_compatible(checkpoint, meta, job.to_dict(), tables=tables, world_size=ranks)
