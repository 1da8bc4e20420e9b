"""Rank side of tests/ranks/distributed/test_one_plan.py: the plan of the Trainer's path and of
``recsys_dist.shard`` for the same config, on a real 2-rank gloo group."""

from __future__ import annotations

import torch
from torchrec.distributed.types import ShardingPlan


def plan_shape(plan: ShardingPlan) -> dict:
    """Table -> (sharding type, compute kernel, ranks, shard sizes, shard offsets): what
    places the table, comparable across processes (plain lists, picklable)."""
    out = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            shards = ps.sharding_spec.shards if ps.sharding_spec is not None else []
            out[table] = (
                ps.sharding_type,
                ps.compute_kernel,
                [s.placement.rank() for s in shards] if shards else sorted(ps.ranks or []),
                [list(s.shard_sizes) for s in shards],
                [list(s.shard_offsets) for s in shards],
            )
    return out


def library_plans(rank: int, world_size: int, overrides: list[list[str]]) -> list[dict]:
    """For each override list: {"trainer": shape of ``shard_model``'s plan, "shard": shape of
    ``recsys_dist.shard``'s plan of the same model and sharding section}."""
    import recsys_dist
    from recsys_dist.config.loader import load_config
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.distributed.optim import fuse_embedding_optimizer
    from recsys_dist.train.build import build_task, shard_model
    from tests.conftest import QUICKSTART

    out = []
    for extra in overrides:
        job = recsys_dist.resolve_job(load_config(QUICKSTART, ["distributed.device=cpu", *extra]))
        ctx = init_distributed(job.distributed)
        dmp, _, _ = shard_model(job, ctx)
        meta = torch.device("meta")
        model = build_task(job, job.features.on(meta, meta))
        fuse_embedding_optimizer(
            model, job.train.embedding_optimizer, job.train.embedding_lr, job.train.embedding_weight_decay
        )
        batch = None if job.sharding.fixed_plan is not None else job.train.batch_size
        lib = recsys_dist.shard(model, job.sharding, device=ctx.device, batch_size=batch, init_tables=False)
        out.append({"trainer": plan_shape(dmp.plan), "shard": plan_shape(lib.plan)})
    return out
