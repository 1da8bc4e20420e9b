"""One rank of the direct resharding check: load a checkpoint into a new plan, gather it."""

from __future__ import annotations


def resharded_state(rank: int, world_size: int, overrides: list[str], checkpoint: str, cache: str):
    import os

    os.environ["RECSYS_DIST_CACHE"] = cache
    from recsys_dist.checkpoint.dcp import canonical_optimizer_state, load_checkpoint
    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.distributed.tables import gather_full_state_dict
    from recsys_dist.train.build import shard_model
    from tests.conftest import QUICKSTART

    job = resolve_job(load_config(QUICKSTART, overrides))
    ctx = init_distributed(job.distributed)
    dmp, optimizer, _ = shard_model(job, ctx)
    state = {
        "model": dmp.state_dict(),
        "optimizer": canonical_optimizer_state(optimizer.state_dict()),
    }  # the RNG states (rng.rank_<r>) are restored only on the same world size
    load_checkpoint(checkpoint, state)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat.update({f"optimizer.{p}.{n}": v for p, entries in state["optimizer"].items() for n, v in entries.items()})
    full = gather_full_state_dict(flat)
    types = sorted({ps.sharding_type for mp in dmp.plan.plan.values() for ps in mp.values()})
    return (full, types) if rank == 0 else (None, types)
