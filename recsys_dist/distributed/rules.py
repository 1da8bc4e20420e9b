"""The rules a ``sharding`` section obeys with a model's tables, a world and a device.

Each rule is written once, here, and called by ``train.preflight`` (before any rank starts)
and by :func:`recsys_dist.distributed.plan.plan` (every planning path: the Trainer,
``shard()``, the dry run). Each returns its problems as "dotted.key: what is wrong; the fix"
(empty when there is none). Torch-free: configs and plain names only.
"""

from __future__ import annotations

from recsys_dist.distributed.config import (
    INTERLEAVED_SCHEDULES,
    SEQUENCE_SHARDING_TYPES,
    CommsConfig,
    DenseConfig,
    ShardingConfig,
)


def table_list(names: list[str]) -> str:
    """``names`` for a message: all of them when few, else the first and the last."""
    return str(list(names)) if len(names) <= 8 else f"{names[0]} .. {names[-1]}"


def per_table_problems(s: ShardingConfig, names: list[str]) -> list[str]:
    """``sharding.per_table`` naming a table the model lacks (``names``: the model's tables)."""
    unknown = sorted(set(s.per_table) - set(names))
    if not unknown:
        return []
    return [f"sharding.per_table: unknown tables {unknown}; the model's tables are {table_list(names)}"]


def fixed_plan_problems(s: ShardingConfig, names: list[str], world_size: int | None = None) -> list[str]:
    """A ``sharding.fixed_plan`` that does not place exactly the tables ``names``, or (with
    ``world_size``) that places one on a rank outside the job."""
    if s.fixed_plan is None:
        return []
    problems = []
    missing = [n for n in names if n not in s.fixed_plan]
    unknown = sorted(set(s.fixed_plan) - set(names))
    if missing or unknown:
        problems.append(
            f"sharding.fixed_plan: must place exactly the model's tables {table_list(names)} (missing {missing}, "
            f"unknown {unknown})"
        )
    if world_size is not None:
        problems += [
            f"sharding.fixed_plan.{name}.ranks: {fp.ranks} but {_ranks_of(s, world_size)}"
            for name, fp in s.fixed_plan.items()
            if any(r >= world_size for r in fp.ranks or [])
        ]
    return problems


def _ranks_of(s: ShardingConfig, world_size: int) -> str:
    """The ranks tables are placed on, for a message: the job's, or under ``sharding.replica_groups``
    one sharding group's (``world_size`` is then the group's size, the ranks a group's own)."""
    if not s.replicated:
        return f"the job has {world_size} rank(s)"
    return (
        f"a sharding group has {world_size} rank(s), numbered 0 .. {world_size - 1} within the group "
        f"(sharding.replica_groups: {s.replica_groups} groups of the job's {world_size * s.replica_groups} ranks, "
        "each holding the same plan)"
    )


def leaves_rank_empty(rows: int, ranks: int) -> bool:
    """Whether row-wise sharding of ``rows`` rows over ``ranks`` ranks gives some rank no row.

    TorchRec cuts ``ceil(rows / ranks)``-row blocks (``_calculate_rw_shard_sizes_and_offsets``:
    5 rows on 4 ranks are 2, 2, 1, 0), and FBGEMM's fused kernel fails on a rank whose shard
    of a table is empty; so such a table must not be sharded row-wise."""
    return ranks > 1 and (ranks - 1) * -(-rows // ranks) >= rows


def row_wise_types(rows: int, world_size: int, local_world_size: int) -> list[str]:
    """The row-sharded types (row_wise, table_row_wise) that would leave a rank without a row
    of a ``rows``-row table (see :func:`leaves_rank_empty`)."""
    out = []
    if leaves_rank_empty(rows, world_size):
        out.append("row_wise")
    if leaves_rank_empty(rows, local_world_size):
        out.append("table_row_wise")
    return out


def small_table_problems(
    s: ShardingConfig, sizes: dict[str, int], world_size: int, local_world_size: int | None = None
) -> list[str]:
    """Tables too small to be sharded row-wise over the job's ranks that the config leaves no
    other sharding type (or places row-wise in a fixed plan), one message per table naming the fix.

    ``sizes``: table name -> rows."""
    local = local_world_size or world_size
    problems = []
    for name, rows in sizes.items():
        bad = row_wise_types(rows, world_size, local)
        if not bad:
            continue
        if s.fixed_plan is not None:
            fp = s.fixed_plan.get(name)
            if fp is not None and fp.sharding_type in bad:
                over = world_size if fp.sharding_type == "row_wise" else local
                problems.append(
                    f"sharding.fixed_plan.{name}: {fp.sharding_type} over {over} ranks leaves a rank without a row "
                    f"of this {rows}-row table, which FBGEMM cannot run; place it table_wise or data_parallel"
                )
            continue
        types = s.allowed_types(name)
        if not [t for t in types if t not in bad]:
            problems.append(
                f"{s.types_key(name)}: {types} leaves table {name} ({rows} rows) only {' / '.join(bad)}, which over "
                f"{world_size} ranks gives a rank no row of it (FBGEMM cannot run that); allow table_wise or "
                f"data_parallel for it (sharding.per_table.{name}.sharding_types: [table_wise]), give it at least "
                f"{world_size} rows, or use fewer ranks"
            )
    return problems


def unpooled_type_problems(s: ShardingConfig, unpooled: list[str] | set[str]) -> list[str]:
    """Why the ``sharding`` section cannot place the EmbeddingCollection (unpooled) tables
    ``unpooled``: a table whose allowed types (``per_table``, else ``sharding_types``; empty =
    all) or ``fixed_plan`` placement include none that TorchRec's EmbeddingCollectionSharder
    offers (:data:`SEQUENCE_SHARDING_TYPES`)."""
    problems = []
    for name in sorted(unpooled):
        fixed = (s.fixed_plan or {}).get(name)
        if fixed is not None:
            if fixed.sharding_type not in SEQUENCE_SHARDING_TYPES:
                problems.append(
                    f"sharding.fixed_plan.{name}.sharding_type: {fixed.sharding_type}, but {name} is an "
                    f"EmbeddingCollection (sequence) table, which TorchRec shards {list(SEQUENCE_SHARDING_TYPES)} "
                    "only; use one of them"
                )
            continue
        if s.fixed_plan is not None:  # the fixed plan must place every table: checked with the model's tables
            continue
        types = s.allowed_types(name)
        if not any(t in SEQUENCE_SHARDING_TYPES for t in types):
            problems.append(
                f"{s.types_key(name)}: {types} leaves the EmbeddingCollection (sequence) table {name} no sharding "
                f"type; TorchRec shards unpooled tables {list(SEQUENCE_SHARDING_TYPES)} only: add one of them "
                f"(e.g. sharding.per_table.{name}.sharding_types: [row_wise])"
            )
    return problems


def comms_problems(
    comms: CommsConfig, device_type: str, world_size: int | None = None, replica_groups: int = 1
) -> list[str]:
    """Why ``sharding.comms`` cannot run on ``device_type`` in a job of ``world_size`` ranks
    (when known; with ``replica_groups`` > 1, ``world_size`` is one sharding group's).

    TorchRec's ``get_qcomm_codecs_registry`` does not carry bf16 over gloo: on CPU it
    replaces bf16 by fp16 with a log warning. A job of 1 rank sends nothing between ranks:
    measured, fp16 comms there give the fp32 run's numbers to the last bit. Refusing both
    keeps the config honest."""
    problems = []
    if world_size == 1 and (comms.forward, comms.backward) != ("fp32", "fp32"):
        who = (
            "a job of 1 rank"
            if replica_groups == 1
            else f"a sharding group of 1 rank (sharding.replica_groups: {replica_groups} groups of the job's "
            f"{replica_groups} ranks)"
        )
        problems.append(
            f"sharding.comms: {who} sends nothing between ranks (its output_dist stays in the "
            "process), so there is nothing to quantize; remove sharding.comms or run on more ranks"
        )
    if device_type == "cuda":
        return problems
    return problems + [
        f"sharding.comms.{key}: bf16 comms need CUDA (NCCL); TorchRec's gloo/CPU codecs carry fp32 and "
        "fp16 only (they would silently send fp16); use fp16 on CPU"
        for key in ("forward", "backward")
        if getattr(comms, key) == "bf16"
    ]


def plan_problems(
    s: ShardingConfig,
    rows: dict[str, int],
    unpooled: set[str],
    world_size: int,
    local_world_size: int,
    device_type: str,
) -> list[str]:
    """Every rule above for a model's tables (``rows``: name -> rows, in module order;
    ``unpooled``: its EmbeddingCollection tables) on a world: what planning checks first."""
    names = list(rows)
    return (
        comms_problems(s.comms, device_type, world_size, s.replica_groups)
        + per_table_problems(s, names)
        + fixed_plan_problems(s, names, world_size)
        + unpooled_type_problems(s, unpooled)
        + small_table_problems(s, rows, world_size, local_world_size)
        + replica_table_problems(s)
    )


def pipeline_layout_problems(d: DenseConfig, world_size: int, batch_size: int) -> list[str]:
    """Why ``distributed.dense`` (strategy pipeline) cannot lay its stages on ``world_size``
    ranks of ``batch_size`` rows each (``train.batch_size``): the stages must divide the ranks
    (``world / stages`` pipelines side by side, data x pipeline), the microbatches must cut a
    pipeline's batch (``batch_size x stages`` rows) evenly (torch's stages size their buffers from
    the first microbatch), and 1f1b needs at least one per stage."""
    if d.strategy != "pipeline" or d.stages is None:
        return []
    problems = []
    if world_size % d.stages:
        fits = [k for k in range(2, world_size + 1) if world_size % k == 0]
        problems.append(
            f"distributed.dense.stages: {d.stages} stages do not divide {world_size} rank(s) (each rank runs one "
            f"stage of one of world / stages pipelines); use one of {fits} or run a multiple of {d.stages} ranks "
            "(distributed.nproc_per_node)"
        )
    m, rows = d.pipeline_microbatches, batch_size * d.stages
    if rows % m:
        fits = [k for k in range(max(2, d.stages), min(rows, 64) + 1) if rows % k == 0][:4]
        problems.append(
            f"distributed.dense.microbatches: {m} does not divide a pipeline's batch of {rows} rows (train.batch_size "
            f"{batch_size} x {d.stages} stages); torch's stages need equal microbatches: use a divisor, e.g. {fits}"
        )
    if d.pipeline_schedule == "1f1b" and m < d.stages:
        problems.append(
            f"distributed.dense.microbatches: 1f1b needs at least one microbatch per stage ({d.stages}), got {m}; "
            f"raise it or use schedule: gpipe"
        )
    problems += interleaved_microbatch_problems(d)
    if d.pipeline_schedule == "2bw" and m < d.stages:  # 2bw runs 1f1b's order within a step
        problems.append(
            f"distributed.dense.microbatches: 2bw runs 1f1b's order, which needs at least one microbatch per "
            f"stage ({d.stages}), got {m}; raise it"
        )
    return problems


def interleaved_microbatch_problems(d: DenseConfig) -> list[str]:
    """torch 2.13's rule of ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble (raised as it
    builds them, on every rank): the microbatches run in ``rounds = max(1, m // stages)`` rounds
    of equal size, so ``m`` must be a multiple of the rounds (any ``m <= stages`` fits)."""
    if d.pipeline_schedule not in INTERLEAVED_SCHEDULES or d.stages is None:
        return []
    m, s = d.pipeline_microbatches, d.stages
    rounds = max(1, m // s)
    if m % rounds == 0:
        return []
    near = sorted({rounds * (m // rounds), s * rounds, s * (rounds + 1)})
    return [
        f"distributed.dense.microbatches: {d.pipeline_schedule} runs {m} microbatches in max(1, {m} // {s} stages) "
        f"= {rounds} rounds of equal size (torch's rule), and {rounds} does not divide {m}; use a multiple of the "
        f"stages or at most {s}, e.g. {near}"
    ]


def pipeline_cut_problems(d: DenseConfig, modules: int | None, why: str = "") -> list[str]:
    """Why the model's tower (``modules`` modules, None: it cannot be cut, ``why``) cannot make
    ``distributed.dense.stages`` stages, or ``split`` does not cut it."""
    if d.strategy != "pipeline" or d.stages is None:
        return []
    if modules is None:
        return [f"distributed.dense.strategy: pipeline: {why}; use strategy ddp or fsdp"]
    n, v = d.pipeline_virtual_stages, d.pipeline_stages_per_rank
    if v > 1 and n > modules:
        return [
            f"distributed.dense.stages_per_rank: {d.stages} stages x {v} stages per rank = {n} stages, but the "
            f"model's tower has {modules} modules to cut (one at least per stage); use stages_per_rank: "
            f"{max(1, modules // d.stages)}, fewer stages, or a deeper model"
        ]
    if n > modules:
        return [
            f"distributed.dense.stages: {d.stages} stages, but the model's tower has {modules} modules to cut "
            f"(one at least per stage); use at most {modules} stages (and as many ranks), or a deeper model"
        ]
    if isinstance(d.split, list):
        bounds = [0, *d.split, modules]
        ok = len(d.split) == n - 1 and all(a < b for a, b in zip(bounds, bounds[1:]))
        if not ok:
            per = f" ({d.stages} stages x {v} per rank)" if v > 1 else ""
            return [
                f"distributed.dense.split: {d.split} must be {n - 1} increasing module indices between 1 and "
                f"{modules - 1} (the first module of each stage after the first{per}), or auto"
            ]
    return []


# What ``sharding.replica_groups`` > 1 runs with (recsys_dist.distributed.replicas): DMPCollection's
# sync averages the TBE weights and FBGEMM's ``sum`` state only (fused Adam keeps exp_avg /
# exp_avg_sq, which it cannot average; and does not run on CPU). The types are those trained and
# compared with one group (tests/ranks/distributed/test_replica_groups.py; data_parallel tables
# are not in the sync, DDP averages their gradients over all ranks every step); table_row_wise fails
# in TorchRec's 2-D intra-node groups (comm.intra_and_cross_node_pg_2D asserts on one node).
REPLICA_OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")
REPLICA_SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")
# train.pipeline: the lookup of the next batch must follow the sync (semi_sync reads the tables
# before the previous update; fused_sparse_dist starts it early too).
REPLICA_PIPELINES = ("base", "sparse_dist")
# distributed.dense.strategy: ddp and fsdp run over the job's ranks (env.process_group, which
# TorchRec's 2-D env keeps global), as one group's would; pipeline lays its data x pipeline grid
# over the job's ranks too, each pipeline inside a sharding group (docs/design/replica_groups.md).
REPLICA_DENSE_STRATEGIES = ("ddp", "fsdp", "pipeline")


def replica_problems(
    s: ShardingConfig,
    world_size: int,
    dense: DenseConfig,
    embedding_optimizer: str,
    pipeline: str = "sparse_dist",
    managed: bool = False,
) -> list[str]:
    """Why ``sharding.replica_groups`` cannot run with this job: it must divide ``world_size``,
    and only the dense strategies of :data:`REPLICA_DENSE_STRATEGIES`, the embedding optimizers of :data:`REPLICA_OPTIMIZERS`,
    the pipelines of :data:`REPLICA_PIPELINES` and no managed-collision ids (``managed``) are
    supported with it; then :func:`replica_table_problems`. Empty when it is 1."""
    n = s.replica_groups
    if n == 1:
        return []
    key = f"sharding.replica_groups: {n}"
    problems = []
    if world_size % n:
        fits = [k for k in range(1, world_size + 1) if world_size % k == 0]
        problems.append(
            f"{key} groups do not divide {world_size} rank(s) (each group holds world / replica_groups ranks); "
            f"use one of {fits} or a multiple of {n} ranks (distributed.nproc_per_node)"
        )
    if dense.strategy not in REPLICA_DENSE_STRATEGIES:
        problems.append(
            f"{key} runs the dense tower under {', '.join(REPLICA_DENSE_STRATEGIES)} only, "
            f"distributed.dense.strategy is {dense.strategy}"
        )
    group = world_size // n
    if dense.strategy == "pipeline" and dense.stages and world_size % n == 0 and group % dense.stages:
        fits = [k for k in range(2, group + 1) if group % k == 0]
        use = f"distributed.dense.stages one of {fits}" if fits else "distributed.dense.strategy ddp or fsdp"
        problems.append(
            f"{key}: distributed.dense.stages: {dense.stages} does not divide a sharding group's {group} rank(s) "
            f"({world_size} ranks / {n} groups): each pipeline runs inside one sharding group, so that every group "
            f"lays its ranks out alike (docs/design/replica_groups.md); use {use}, fewer replica_groups or more ranks"
        )
    if embedding_optimizer not in REPLICA_OPTIMIZERS:
        problems.append(
            f"{key}: train.embedding_optimizer {embedding_optimizer} keeps state the replicas' sync cannot "
            f"average (it averages weights and FBGEMM's 'sum' state); use one of {list(REPLICA_OPTIMIZERS)}"
        )
    if pipeline not in REPLICA_PIPELINES:
        problems.append(
            f"{key}: train.pipeline {pipeline} looks up the next batch before the replicas' sync; use one of "
            f"{list(REPLICA_PIPELINES)}"
        )
    if managed:
        problems.append(
            f"{key}: managed-collision ids (data.categorical_mapping: managed) are not supported with replica "
            "groups; use hashed or vocabulary ids, or replica_groups: 1"
        )
    return problems + replica_table_problems(s)


def replica_table_problems(s: ShardingConfig) -> list[str]:
    """Under ``sharding.replica_groups`` > 1: sharding types outside :data:`REPLICA_SHARDING_TYPES`
    asked for by name (an empty ``sharding.sharding_types`` lets the planner choose among those
    only). Sequence (EmbeddingCollection) tables are synced like pooled ones (their fused shards
    are FBGEMM TBEs too): tests/ranks/distributed/test_replica_groups.py."""
    if not s.replicated:
        return []
    problems = []
    asked = [("sharding.sharding_types", s.sharding_types)]
    asked += [(f"sharding.per_table.{n}.sharding_types", t.sharding_types) for n, t in s.per_table.items()]
    asked += [(f"sharding.fixed_plan.{n}.sharding_type", [p.sharding_type]) for n, p in (s.fixed_plan or {}).items()]
    for where, types in asked:
        bad = [t for t in types if t not in REPLICA_SHARDING_TYPES]
        if bad:
            problems.append(
                f"{where}: {bad} not supported with sharding.replica_groups > 1 (table_row_wise fails in TorchRec's "
                "2-D node groups, table_column_wise is not tried; "
                f"docs/design/replica_groups.md); use {list(REPLICA_SHARDING_TYPES)}"
            )
    return problems
