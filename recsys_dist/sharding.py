"""Sharding glue: sharders that offer every sharding type on CPU, the planner, the plan.

TorchRec's ``EmbeddingBagCollectionSharder`` reports only data_parallel, table_wise,
column_wise and table_column_wise on CPU, although row_wise and table_row_wise train
correctly over gloo. :class:`EmbeddingBagCollectionSharderAllTypes` reports them all,
so the planner (and our tests) can use every type on CPU.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.types import CacheParams, ModuleSharder, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recsys_dist.config.base import Section as _Section

SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
)
ShardingTypeName = Literal[
    "data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"
]
ComputeKernelName = Literal["dense", "fused", "fused_uvm", "fused_uvm_caching"]
CUDA_ONLY_KERNELS = ("fused_uvm", "fused_uvm_caching")


class TableConstraint(_Section):
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=list, description="Sharding types the planner may choose for this table."
    )
    compute_kernels: list[ComputeKernelName] = Field(
        default_factory=list, description="Compute kernels the planner may choose for this table."
    )


class FixedPlacement(_Section):
    sharding_type: ShardingTypeName = Field(description="How this table is sharded.")
    ranks: list[int] | None = Field(
        None,
        description="table_wise: one rank; column_wise: the rank of each column shard (may repeat); "
        "row_wise / data_parallel: ignored (all ranks); table_row_wise: the ranks of one node.",
    )
    compute_kernel: ComputeKernelName | None = Field(
        None, description="None = dense for data_parallel, fused otherwise."
    )

    @model_validator(mode="after")
    def _check(self) -> FixedPlacement:
        if self.sharding_type == "table_column_wise":
            raise ValueError(
                "table_column_wise is not available in a fixed plan; use column_wise with ranks on one node"
            )
        if self.sharding_type in ("table_wise", "column_wise", "table_row_wise") and not self.ranks:
            raise ValueError(f"{self.sharding_type} needs ranks, e.g. ranks: [0]")
        if self.sharding_type == "table_wise" and len(self.ranks or []) != 1:
            raise ValueError(f"table_wise needs exactly one rank, got {self.ranks}")
        if any(r < 0 for r in self.ranks or []):
            raise ValueError(f"ranks must be >= 0, got {self.ranks}")
        return self


class ShardingConfig(_Section):
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=list,
        description="Sharding types allowed for every table (empty = all six).",
    )
    compute_kernels: list[ComputeKernelName] = Field(
        default_factory=lambda: ["fused", "dense"],
        description="Kernels allowed for every table: dense (data_parallel only), fused (FBGEMM "
        "table-batched, weights in device memory), and on CUDA fused_uvm (weights in host "
        "memory) and fused_uvm_caching (host memory with a device cache).",
    )
    planner_batch_size: int | None = Field(
        None, gt=0, description="Per-rank batch size the planner's cost model assumes (None = train.batch_size)."
    )
    cache_load_factor: float | None = Field(
        None, gt=0, le=1, description="fused_uvm_caching: fraction of each table's rows cached on device."
    )
    per_table: dict[str, TableConstraint] = Field(
        default_factory=dict, description="Overrides by table name (t_<feature>, w_<feature> for first-order tables)."
    )
    storage_reservation: float = Field(
        0.15, ge=0, lt=1, description="Fraction of each rank's memory the planner keeps free."
    )
    fixed_plan: dict[str, FixedPlacement] | None = Field(
        None,
        description="Place every table by hand instead of planning (table -> sharding_type, ranks). "
        "`recsys-dist train --plan RUN_DIR/plan.json` fills it from an earlier run.",
    )
    hbm_gb: float | None = Field(None, gt=0, description="Device memory per rank in GB (None = TorchRec's 32 GB).")
    ddr_gb: float | None = Field(None, gt=0, description="Host memory per rank in GB (None = TorchRec's 128 GB).")
    intra_node_bandwidth_gbps: float | None = Field(
        None, gt=0, description="Bandwidth between ranks of one node in GB/s (None = TorchRec's 600)."
    )
    inter_node_bandwidth_gbps: float | None = Field(
        None, gt=0, description="Bandwidth between nodes per rank in GB/s (None = TorchRec's 12.5)."
    )


ALL_TYPES = [ShardingType(t).value for t in SHARDING_TYPES]


class EmbeddingBagCollectionSharderAllTypes(EmbeddingBagCollectionSharder):
    """EBC sharder offering every sharding type on every device, CPU included."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(ALL_TYPES)


class OneRankDense(DataParallelWrapper):
    """DMP's data-parallel wrapper for a world of one rank: the dense modules stay as they are
    (moved to the device) instead of going into DistributedDataParallel, whose per-step
    bucketing and all-reduce have nothing to synchronise there. State-dict keys are the same
    either way (DMP unwraps DDP), so checkpoints move between world sizes as before."""

    def wrap(self, dmp, env, device: torch.device) -> None:
        if env.world_size != 1:
            raise ValueError(f"OneRankDense is for a world of one rank, not {env.world_size}")
        dmp._dmp_wrapped_module = dmp._dmp_wrapped_module.to(device)


def model_tables(model: nn.Module) -> list[EmbeddingBagConfig]:
    """The configs of every table in the EmbeddingBagCollections of ``model``, in module order."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return [t for m in model.modules() if isinstance(m, EmbeddingBagCollection) for t in m.embedding_bag_configs()]


def sharders() -> list[ModuleSharder[nn.Module]]:
    return [EmbeddingBagCollectionSharderAllTypes()]


def constraints(cfg, tables: list[EmbeddingBagConfig]) -> dict[str, ParameterConstraints]:
    """Per-table planner constraints of a run config: its ``sharding`` section (per_table wins)
    and ``data.multi_hot_sizes`` (pooling factors of the ``t_`` tables and their first-order twins)."""
    hot = cfg.data.multi_hot_sizes
    by_feature = dict(zip([t.feature_names[0] for t in tables if t.name.startswith("t_")], hot)) if hot else {}
    sizes = [by_feature.get(t.feature_names[0], 1) for t in tables] if hot else None
    return table_constraints(cfg.sharding, [t.name for t in tables], sizes)


def table_constraints(
    s: ShardingConfig, names: list[str], multi_hot_sizes: list[int] | None = None
) -> dict[str, ParameterConstraints]:
    """Planner constraints for tables ``names`` from a ``sharding`` config section.

    Raises:
        ValueError: ``sharding.per_table`` names a table the model does not have.
    """
    unknown = sorted(set(s.per_table) - set(names))
    if unknown:
        raise ValueError(f"sharding.per_table: unknown tables {unknown}; tables are {names[0]} .. {names[-1]}")
    hot = multi_hot_sizes
    out = {}
    for i, name in enumerate(names):
        override = s.per_table.get(name)
        types = (override and override.sharding_types) or s.sharding_types or list(ALL_TYPES)
        kernels = (override and override.compute_kernels) or s.compute_kernels
        cache = CacheParams(load_factor=s.cache_load_factor) if s.cache_load_factor else None
        out[name] = ParameterConstraints(
            sharding_types=list(types),
            compute_kernels=list(kernels),
            pooling_factors=[float(hot[i])] if hot else [1.0],
            cache_params=cache,
        )
    return out


def make_topology(cfg, world_size: int, local_world_size: int, compute_device: str) -> Topology:
    """TorchRec's Topology for a ``sharding`` section (or a run config holding one)."""
    s = getattr(cfg, "sharding", cfg)
    gb = 1024**3
    kwargs = {}
    if s.hbm_gb:
        kwargs["hbm_cap"] = int(s.hbm_gb * gb)
    if s.ddr_gb:
        kwargs["ddr_cap"] = int(s.ddr_gb * gb)
    # TorchRec's bandwidths are in bytes per millisecond.
    if s.intra_node_bandwidth_gbps:
        kwargs["intra_host_bw"] = s.intra_node_bandwidth_gbps * gb / 1000
    if s.inter_node_bandwidth_gbps:
        kwargs["inter_host_bw"] = s.inter_node_bandwidth_gbps * gb / 1000
    return Topology(world_size=world_size, local_world_size=local_world_size, compute_device=compute_device, **kwargs)


def make_planner(
    cfg,
    tables: list[EmbeddingBagConfig],
    world_size: int,
    local_world_size: int,
    compute_device: str,
    batch_size: int | None = None,
) -> EmbeddingShardingPlanner:
    return EmbeddingShardingPlanner(
        topology=make_topology(cfg, world_size, local_world_size, compute_device),
        batch_size=batch_size or cfg.sharding.planner_batch_size or cfg.train.batch_size,
        constraints=constraints(cfg, tables),
        storage_reservation=HeuristicalStorageReservation(percentage=cfg.sharding.storage_reservation),
    )


def fixed_sharding_plan(
    model: nn.Module, fixed: dict, world_size: int, local_world_size: int, device_type: str
) -> ShardingPlan:
    """A ShardingPlan placing each table as ``sharding.fixed_plan`` says (no planner).

    Raises:
        ValueError: a rank outside the job, or table_row_wise ranks spanning two nodes.
    """
    from torchrec.distributed import sharding_plan as sp
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    sharder = EmbeddingBagCollectionSharderAllTypes()
    plan = {}
    for path, module in model.named_modules():
        if not isinstance(module, EmbeddingBagCollection):
            continue
        per_table = {}
        for t in module.embedding_bag_configs():
            fp = fixed[t.name]
            ranks = list(fp.ranks or [])
            if any(r >= world_size for r in ranks):
                raise ValueError(f"sharding.fixed_plan.{t.name}.ranks: {ranks} but the job has {world_size} rank(s)")
            kernel = fp.compute_kernel or ("dense" if fp.sharding_type == "data_parallel" else "fused")
            if fp.sharding_type == "data_parallel":
                gen = sp.data_parallel()
            elif fp.sharding_type == "table_wise":
                gen = sp.table_wise(rank=ranks[0], compute_kernel=kernel)
            elif fp.sharding_type == "row_wise":
                gen = sp.row_wise(compute_kernel=kernel)
            elif fp.sharding_type == "column_wise":
                width = t.embedding_dim / len(ranks)
                if width != int(width) or int(width) % 4:
                    ok = [n for n in range(1, t.embedding_dim // 4 + 1) if t.embedding_dim % (4 * n) == 0]
                    raise ValueError(
                        f"sharding.fixed_plan.{t.name}: {t.embedding_dim} columns over {len(ranks)} shards gives "
                        f"width {width:g}; FBGEMM's fused kernel needs shard widths that are multiples of 4: "
                        f"use {ok} shards"
                    )
                gen = sp.column_wise(ranks=ranks, compute_kernel=kernel)
            else:  # table_row_wise
                hosts = {r // local_world_size for r in ranks}
                if len(hosts) != 1:
                    raise ValueError(
                        f"sharding.fixed_plan.{t.name}: table_row_wise ranks {ranks} span nodes {sorted(hosts)}"
                    )
                gen = sp.table_row_wise(host_index=hosts.pop())
            per_table[t.name] = gen
        plan[path] = sp.construct_module_sharding_plan(
            module,
            per_table,
            sharder=sharder,
            local_size=local_world_size,
            world_size=world_size,
            device_type=device_type,
        )
    return ShardingPlan(plan)


def check_column_shards(plan: ShardingPlan) -> None:
    """Refuse a plan whose column shards are not multiples of 4 wide (FBGEMM would assert).

    Raises:
        ValueError: names the table, its shard widths and what to change.
    """
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            if ps.sharding_spec is None or ps.compute_kernel == "dense":
                continue
            widths = [s.shard_sizes[1] for s in ps.sharding_spec.shards]
            if any(w % 4 for w in widths):
                raise ValueError(
                    f"table {table}: {ps.sharding_type} shards of widths {widths}; FBGEMM's fused kernel needs "
                    f"multiples of 4. Use an embedding_dim that is a multiple of 4 per shard, or leave "
                    f"column_wise / table_column_wise out of sharding.per_table.{table}.sharding_types"
                )


def load_plan_file(path: str) -> dict:
    """``plan.json`` of an earlier run -> a ``sharding.fixed_plan`` mapping.

    Raises:
        ValueError: the file is not a plan.json (a list of table placements).
    """
    import json

    try:
        rows = json.loads(open(path).read())
        return {
            r["table"]: {
                "sharding_type": r["sharding_type"],
                "ranks": r["ranks"] or None,
                "compute_kernel": r["compute_kernel"],
            }
            for r in rows
        }
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--plan {path}: not a readable plan.json ({err})") from None


def collective_plan(
    cfg,
    model: nn.Module,
    tables: list[EmbeddingBagConfig],
    device: torch.device,
    pg: dist.ProcessGroup,
) -> ShardingPlan:
    """The fixed plan from the config, or a planner's plan made on rank 0 and broadcast."""
    world = dist.get_world_size(pg)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if cfg.sharding.fixed_plan is not None:
        plan = fixed_sharding_plan(model, cfg.sharding.fixed_plan, world, local, device.type)
        check_column_shards(plan)
        return plan
    planner = make_planner(cfg, tables, world, local, device.type)
    plan = planner.collective_plan(model, sharders(), pg)
    check_column_shards(plan)
    return plan


def plan_summary(plan: ShardingPlan, tables: list[EmbeddingBagConfig] | None = None) -> list[dict]:
    """Machine-readable plan: one entry per table with type, kernel, ranks and, per rank,
    the bytes of fp32 weights it holds (``rank_bytes``; replicas count on every rank;
    data-parallel sizes need ``tables``)."""
    shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in tables or []}
    rows = []
    for module_path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            shard_ranks = (
                [s.placement.rank() for s in ps.sharding_spec.shards] if ps.sharding_spec else list(ps.ranks or [])
            )
            # Column shards keep their order (a rank may hold several); others list each rank once.
            ranks = shard_ranks if "column" in ps.sharding_type else list(dict.fromkeys(shard_ranks))
            rank_bytes: dict[int, int] = {}
            if ps.sharding_spec:
                for sh in ps.sharding_spec.shards:
                    r = sh.placement.rank()
                    rank_bytes[r] = rank_bytes.get(r, 0) + sh.shard_sizes[0] * sh.shard_sizes[1] * 4
            elif table in shapes:
                rank_bytes = {r: shapes[table][0] * shapes[table][1] * 4 for r in ranks}
            rows.append(
                {
                    "module": module_path,
                    "table": table,
                    "sharding_type": ps.sharding_type,
                    "compute_kernel": ps.compute_kernel,
                    "ranks": ranks,
                    "rank_bytes": {str(r): b for r, b in sorted(rank_bytes.items())},
                }
            )
    return rows


def shard(
    model: nn.Module,
    sharding: ShardingConfig | dict | None = None,
    *,
    device: torch.device | None = None,
    batch_size: int = 512,
    pg: dist.ProcessGroup | None = None,
):
    """Shard any ``nn.Module`` holding TorchRec EmbeddingBagCollections; returns a DMP.

    Plans with ``EmbeddingShardingPlanner`` on the process group (every sharding type is
    allowed on CPU too), then wraps the model in ``DistributedModelParallel``: tables are
    sharded, everything else is data-parallel (DDP). Build the model on ``meta`` so no
    table memory is allocated before sharding, and call ``apply_optimizer_in_backward``
    on the tables first to choose their fused optimizer (default: SGD, lr 0.01).

    Args:
        model: e.g. a model with an ``EmbeddingBagCollection`` submodule.
        sharding: the ``sharding:`` config section (a ShardingConfig or a plain dict),
            e.g. ``{"sharding_types": ["row_wise"]}``. None = planner's choice.
        device: compute device (default: cuda:LOCAL_RANK when available, else cpu).
        batch_size: per-rank batch size the planner assumes for its cost estimates.
        pg: process group (default: the world; it must already be initialised).

    Returns:
        ``torchrec.distributed.DistributedModelParallel``; its ``.plan`` is the plan used.

    Raises:
        ValueError: bad sharding config (pydantic validation), or unknown table names.
    """
    from torchrec.distributed import DistributedModelParallel
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    s = sharding if isinstance(sharding, ShardingConfig) else ShardingConfig.model_validate(sharding or {})
    pg = pg or dist.group.WORLD
    if device is None:
        device = (
            torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    names = [
        t.name for m in model.modules() if isinstance(m, EmbeddingBagCollection) for t in m.embedding_bag_configs()
    ]
    world = dist.get_world_size(pg)
    planner = EmbeddingShardingPlanner(
        topology=make_topology(s, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), device.type),
        batch_size=batch_size,
        constraints=table_constraints(s, names),
        storage_reservation=HeuristicalStorageReservation(percentage=s.storage_reservation),
    )
    plan = planner.collective_plan(model, sharders(), pg)
    check_column_shards(plan)
    return DistributedModelParallel(model, device=device, plan=plan, sharders=sharders())
