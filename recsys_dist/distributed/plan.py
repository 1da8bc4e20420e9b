"""THE planning path: :func:`plan` places a model's tables for a world, real or simulated.

The Trainer (``train.trainer.shard_model``, through :func:`run_plan`), the public
:func:`recsys_dist.shard` and the dry run (``recsys-dist plan``, a simulated world) all call
:func:`plan`, so a config gives the same plan on each: the rules of
:mod:`recsys_dist.distributed.rules`, then the fixed plan or TorchRec's planner (constraints
with the small-table filter, :class:`OrderedEnumerator`, the topology), then the column-shard
check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import ShardingOption, Stats
from torchrec.distributed.types import CacheParams, ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsys_dist.distributed.config import SEQUENCE_SHARDING_TYPES, ShardingConfig
from recsys_dist.distributed.fixed_plan import fixed_sharding_plan
from recsys_dist.distributed.rules import (
    REPLICA_SHARDING_TYPES,
    fixed_plan_problems,
    per_table_problems,
    plan_problems,
    row_wise_types,
)
from recsys_dist.distributed.sharders import check_covered, model_tables, sharders, unpooled_names
from recsys_dist.section import ConfigError

GB = 1024**3


@dataclass(frozen=True)
class World:
    """The ranks a plan is for. ``pg`` None: a simulated world (the dry run), planned in this
    process; else every rank of ``pg`` calls :func:`plan`, rank 0 plans and broadcasts."""

    size: int
    local_size: int
    device_type: str
    pg: dist.ProcessGroup | None = None

    @classmethod
    def of_group(cls, pg: dist.ProcessGroup, device_type: str) -> World:
        """The world of ``pg``; ranks per node from ``$LOCAL_WORLD_SIZE`` (the launcher's), else all."""
        size = dist.get_world_size(pg)
        return cls(size, int(os.environ.get("LOCAL_WORLD_SIZE", size)), device_type, pg)

    def sharding_group(self, groups: int) -> World:
        """The world one of ``groups`` sharding groups is (``sharding.replica_groups``): world /
        groups ranks, the node's ranks of the group (ranks g, g + groups, ... form group g), and the
        same ``pg``: every rank of the job plans and gets rank 0's plan.

        Raises:
            ValueError: ``groups`` does not divide the world.
        """
        if groups == 1:
            return self
        if self.size % groups:
            raise ValueError(f"sharding.replica_groups: {groups} groups do not divide {self.size} rank(s)")
        local = self.local_size // groups if self.local_size % groups == 0 else 1
        return World(self.size // groups, max(local, 1), self.device_type, self.pg)


class ChosenOptions(Stats):
    """A planner stats hook keeping the chosen sharding options (each shard's rank, storage and
    estimated cost), which TorchRec hands to its stats and keeps nowhere public."""

    def __init__(self) -> None:
        self.options: list[ShardingOption] = []

    def log(self, sharding_plan, topology, batch_size, storage_reservation, num_proposals, num_plans, run_time,
            best_plan, *args, **kwargs) -> None:  # fmt: skip
        self.options = list(best_plan)


def make_topology(s: ShardingConfig, world_size: int, local_world_size: int, compute_device: str) -> Topology:
    """TorchRec's Topology for a ``sharding`` section (memory in bytes, bandwidths in bytes per ms)."""
    kwargs = {}
    if s.hbm_gb:
        kwargs["hbm_cap"] = int(s.hbm_gb * GB)
    if s.ddr_gb:
        kwargs["ddr_cap"] = int(s.ddr_gb * GB)
    if s.intra_node_bandwidth_gbps:
        kwargs["intra_host_bw"] = s.intra_node_bandwidth_gbps * GB / 1000
    if s.inter_node_bandwidth_gbps:
        kwargs["inter_host_bw"] = s.inter_node_bandwidth_gbps * GB / 1000
    return Topology(world_size=world_size, local_world_size=local_world_size, compute_device=compute_device, **kwargs)


def pooling_factors(tables: list[BaseEmbeddingConfig], multi_hot_sizes: list[int] | None) -> dict[str, float]:
    """Table name -> ids per example, from ``data.multi_hot_sizes`` (one per ``t_`` table, in
    order; a first-order twin shares its feature's); empty without them (1 each)."""
    if not multi_hot_sizes:
        return {}
    by_feature = dict(zip([t.feature_names[0] for t in tables if t.name.startswith("t_")], multi_hot_sizes))
    return {t.name: float(by_feature.get(t.feature_names[0], 1)) for t in tables}


def table_constraints(
    s: ShardingConfig,
    tables: list[BaseEmbeddingConfig],
    world: World | None = None,
    pooling: dict[str, float] | None = None,
) -> dict[str, ParameterConstraints]:
    """Planner constraints per table from a ``sharding`` section (``per_table`` wins).

    EmbeddingCollection tables keep only the types their sharder offers
    (``SEQUENCE_SHARDING_TYPES``); with ``world``, a table too small to give every rank a row is
    not offered row_wise (table_row_wise: over a node's ranks). ``pooling``: ids per example
    by table (default 1). The config's own problems are :func:`rules.plan_problems`'.
    """
    unpooled = unpooled_names(tables)
    cache = CacheParams(load_factor=s.cache_load_factor) if s.cache_load_factor else None
    out = {}
    for t in tables:
        types = s.allowed_types(t.name)
        if s.replicated:  # the types replica groups run (rules.REPLICA_SHARDING_TYPES)
            types = [x for x in types if x in REPLICA_SHARDING_TYPES]
        if t.name in unpooled:
            types = [x for x in types if x in SEQUENCE_SHARDING_TYPES]
        if world is not None:
            bad = row_wise_types(t.num_embeddings, world.size, world.local_size)
            types = [x for x in types if x not in bad]
        override = s.per_table.get(t.name)
        out[t.name] = ParameterConstraints(
            sharding_types=list(types),
            compute_kernels=list((override and override.compute_kernels) or s.compute_kernels),
            pooling_factors=[(pooling or {}).get(t.name, 1.0)],
            cache_params=cache,
        )
    return out


class OrderedEnumerator(EmbeddingEnumerator):
    """TorchRec's enumerator with each table's sharding types and compute kernels in the
    sharder's order. TorchRec intersects them as Python sets, whose order follows the process's
    string-hash seed, and the planner keeps the first of options that tie on cost: two equal
    runs of the 2-rank quickstart were planned row_wise in one and table_row_wise in the other."""

    def _filter_sharding_types(self, name: str, allowed_sharding_types: list[str], *args, **kwargs) -> list[str]:
        found = super()._filter_sharding_types(name, allowed_sharding_types, *args, **kwargs)
        return sorted(found, key=_order(allowed_sharding_types))

    def _filter_compute_kernels(self, name: str, allowed_compute_kernels: list[str], *args, **kwargs) -> list[str]:
        found = super()._filter_compute_kernels(name, allowed_compute_kernels, *args, **kwargs)
        return sorted(found, key=_order(allowed_compute_kernels))


def _order(allowed: list[str]):
    """Sort key: the position in ``allowed``, then the name (for anything not in it)."""
    return lambda x: (allowed.index(x) if x in allowed else len(allowed), x)


def planner(
    topology: Topology,
    batch_size: int,
    constraints: dict[str, ParameterConstraints],
    reservation: float,
    stats: list[Stats] | None = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's planner with :class:`OrderedEnumerator`: the same inputs give the same plan in every
    process. ``stats``: hooks besides TorchRec's own (which logs the plan's table)."""
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        storage_reservation=HeuristicalStorageReservation(percentage=reservation),
        enumerator=OrderedEnumerator(topology=topology, batch_size=batch_size, constraints=constraints),
        stats=None if not stats else [EmbeddingStats(), *stats],  # TorchRec's default stays
    )


def check_column_shards(sharding_plan: ShardingPlan) -> None:
    """Refuse a plan whose column shards are not multiples of 4 wide (FBGEMM would assert).

    Raises:
        ValueError: names the table, its shard widths and what to change.
    """
    for module_plan in sharding_plan.plan.values():
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


def checked_tables(
    model: nn.Module, s: ShardingConfig, world: World | None = None, config_error: bool = False
) -> list[BaseEmbeddingConfig]:
    """The tables of ``model`` once it and ``s`` pass what planning checks first:
    :func:`check_covered`, at least one table, and the rules of :func:`rules.plan_problems`
    (without ``world``: only those needing no world, so ``shard()`` refuses them before it
    asks the process group anything).

    Raises:
        ConfigError: (``config_error``) the rules' problems, one per line; else ValueError,
            the problems joined by "; ".
        ValueError: an uncovered embedding module, no tables, duplicate table names.
    """
    check_covered(model)
    tables = model_tables(model)
    if not tables:
        raise ValueError(
            f"{type(model).__name__} holds no EmbeddingBagCollection or EmbeddingCollection: nothing to shard"
        )
    names = [t.name for t in tables]
    if world is None:
        problems = per_table_problems(s, names) + fixed_plan_problems(s, names)
    else:
        rows = {t.name: t.num_embeddings for t in tables}
        problems = plan_problems(s, rows, unpooled_names(tables), world.size, world.local_size, world.device_type)
    if problems and config_error:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))
    if problems:
        raise ValueError("; ".join(problems))
    return tables


def plan(
    model: nn.Module,
    s: ShardingConfig,
    world: World,
    batch_size: int,
    pooling: dict[str, float] | None = None,
    *,
    stats: list[Stats] | None = None,
    config_error: bool = False,
) -> ShardingPlan:
    """Place the tables of ``model`` (EmbeddingBagCollections and EmbeddingCollections) on ``world``.

    In order: :func:`checked_tables` (:func:`check_covered`, then the rules of
    :func:`rules.plan_problems`: comms on this device, ``per_table`` / ``fixed_plan`` naming
    the model's tables and ranks inside the job, sequence tables, small tables vs row-wise);
    under ``sharding.replica_groups`` N all that for one group of ``world.size / N`` ranks
    (:meth:`World.sharding_group`); then ``s.fixed_plan`` as it says
    (:func:`fixed_sharding_plan`), or TorchRec's planner over :func:`table_constraints` and
    :func:`make_topology` (``batch_size``: per-rank batch of its cost model; ``pooling``: ids
    per example by table; ``stats``: extra planner stats hooks); then :func:`check_column_shards`.

    Raises:
        ConfigError: (``config_error``, the Trainer's and the dry run's form) the rules'
            problems, one per line; else ValueError, the problems joined by "; ".
        ValueError: an uncovered embedding module, no tables, bad fixed column shards or
            table_row_wise ranks over two nodes, column shards not multiples of 4.
        torchrec PlannerError: no placement fits the topology (planner only).
    """
    world = world.sharding_group(s.replica_groups)  # planned for one group, the same plan in each
    tables = checked_tables(model, s, world, config_error)
    if s.fixed_plan is not None:
        out = fixed_sharding_plan(model, s.fixed_plan, world.size, world.local_size, world.device_type)
    else:
        topology = make_topology(s, world.size, world.local_size, world.device_type)
        found = planner(
            topology, batch_size, table_constraints(s, tables, world, pooling), s.storage_reservation, stats
        )
        wrap = sharders(s.comms, world.device_type)
        out = found.plan(model, wrap) if world.pg is None else found.collective_plan(model, wrap, world.pg)
    check_column_shards(out)
    return out
