"""A plan as rows (``plan.json``, the run's summary) and back as a ``sharding.fixed_plan``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: load_plan_file (recsys-dist train --plan) imports no torch
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import BaseEmbeddingConfig


def plan_summary(sharding_plan: ShardingPlan, tables: list[BaseEmbeddingConfig] | None = None) -> list[dict]:
    """Machine-readable plan: one entry per table with type, kernel, ranks and, per rank,
    the bytes of fp32 weights it holds (``rank_bytes``; replicas count on every rank;
    data-parallel sizes need ``tables``)."""
    shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in tables or []}
    rows = []
    for module_path, module_plan in sharding_plan.plan.items():
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


def load_plan_file(path: str) -> dict:
    """``plan.json`` of an earlier run -> a ``sharding.fixed_plan`` mapping.

    Raises:
        ValueError: the file is not a plan.json (a list of table placements).
    """
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
