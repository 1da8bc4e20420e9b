"""A ShardingPlan from ``sharding.fixed_plan``: each table placed by hand, no planner.

:data:`FIXED_PLACEMENT` maps each sharding type a fixed plan may use to the function that
builds TorchRec's parameter-sharding generator for it; a new type is one entry there.
The config's rules (coverage, ranks inside the job, small tables, sequence tables) are
checked before, by :func:`recsys_dist.distributed.plan.plan`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torchrec.distributed import sharding_plan as sp
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_dist.distributed.config import FixedPlacement, ShardingType
from recsys_dist.distributed.sharders import EmbeddingBagCollectionSharderAllTypes, OrderedEmbeddingCollectionSharder

# (table, its ranks, compute kernel, local world size) -> TorchRec's ParameterShardingGenerator
Placement = Callable[[BaseEmbeddingConfig, list[int], str, int], Callable]


def _table_wise(t: BaseEmbeddingConfig, ranks: list[int], kernel: str, local: int) -> Callable:
    return sp.table_wise(rank=ranks[0], compute_kernel=kernel)


def _column_wise(t: BaseEmbeddingConfig, ranks: list[int], kernel: str, local: int) -> Callable:
    width = t.embedding_dim / len(ranks)
    if width != int(width) or int(width) % 4:
        ok = [n for n in range(1, t.embedding_dim // 4 + 1) if t.embedding_dim % (4 * n) == 0]
        raise ValueError(
            f"sharding.fixed_plan.{t.name}: {t.embedding_dim} columns over {len(ranks)} shards gives "
            f"width {width:g}; FBGEMM's fused kernel needs shard widths that are multiples of 4: "
            f"use {ok} shards"
        )
    return sp.column_wise(ranks=ranks, compute_kernel=kernel)


def _table_row_wise(t: BaseEmbeddingConfig, ranks: list[int], kernel: str, local: int) -> Callable:
    hosts = {r // local for r in ranks}
    if len(hosts) != 1:
        raise ValueError(f"sharding.fixed_plan.{t.name}: table_row_wise ranks {ranks} span nodes {sorted(hosts)}")
    return sp.table_row_wise(host_index=hosts.pop())


# table_column_wise is not offered: FixedPlacement refuses it (column_wise on one node's ranks does that).
FIXED_PLACEMENT: dict[ShardingType, Placement] = {
    "data_parallel": lambda t, ranks, kernel, local: sp.data_parallel(),
    "table_wise": _table_wise,
    "row_wise": lambda t, ranks, kernel, local: sp.row_wise(compute_kernel=kernel),
    "column_wise": _column_wise,
    "table_row_wise": _table_row_wise,
}


def fixed_sharding_plan(
    model: nn.Module, fixed: dict[str, FixedPlacement], world_size: int, local_world_size: int, device_type: str
) -> ShardingPlan:
    """A ShardingPlan placing each table of ``model`` as ``fixed`` (``sharding.fixed_plan``) says.

    Raises:
        ValueError: column shards not multiples of 4 wide, or table_row_wise ranks spanning two nodes.
    """
    plan = {}
    for path, module in model.named_modules():
        if isinstance(module, EmbeddingBagCollection):
            sharder, configs = EmbeddingBagCollectionSharderAllTypes(), module.embedding_bag_configs()
        elif isinstance(module, EmbeddingCollection):
            sharder, configs = OrderedEmbeddingCollectionSharder(), module.embedding_configs()
        else:
            continue
        per_table = {}
        for t in configs:
            fp = fixed[t.name]
            kernel = fp.compute_kernel or ("dense" if fp.sharding_type == "data_parallel" else "fused")
            per_table[t.name] = FIXED_PLACEMENT[fp.sharding_type](t, list(fp.ranks or []), kernel, local_world_size)
        plan[path] = sp.construct_module_sharding_plan(
            module,
            per_table,
            sharder=sharder,
            local_size=local_world_size,
            world_size=world_size,
            device_type=device_type,
        )
    return ShardingPlan(plan)
