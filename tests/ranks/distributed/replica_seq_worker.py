"""``sharding.replica_groups`` with sequence (EmbeddingCollection) tables: one rank's side of
tests/ranks/distributed/test_replica_groups.py's HSTU case (run via run_ranks).

configs/movielens_hstu.yaml (its userId / movieId / genres tables pooled, its history and
history_action tables sequence tables; ids hashed into 200 rows, no dropout, exact_sgd) through
the trainer's sharding path from one seed, on the same per-rank batches
(``tests.ranks.models.hstu_worker.movielens_batch``): one group of all ranks against
``groups`` replica groups synced every step, and a checkpoint moved between the two layouts.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from recsys_dist.checkpoint.loop import load_checkpoint, save_checkpoint
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.distributed.env import init_distributed
from recsys_dist.distributed.ledger import run_ledger
from recsys_dist.distributed.tables import gather_full_state_dict
from recsys_dist.train.build import shard_model
from tests.conftest import ROOT
from tests.ranks.distributed import replica_worker
from tests.ranks.distributed.replica_worker import _replicas_agree, _sync_payload
from tests.ranks.models.hstu_worker import B, movielens_batch

SEQUENCE_TABLES = ("s_history", "s_history_action")


def _build(types: list[str], groups: int, world_size: int, seed_offset: int = 0):
    job = resolve_job(
        load_config(
            ROOT / "configs" / "movielens_hstu.yaml",
            [
                "data.categorical_mapping=hash",  # no data files: ids hashed into 200 rows
                "data.num_embeddings=200",
                "model.embedding_init_scale=0.5",  # the history moves the logits well past rounding
                "model.layer_dropout=0.0",
                "train.embedding_optimizer=exact_sgd",
                "train.embedding_lr=2.0",  # the sequence tables' rows move ~1e-3 in 8 steps (~2e-5 at the config's 0.05)
                f"sharding.sharding_types=[{', '.join(types)}]",
                f"sharding.replica_groups={groups}",
                f"distributed.nproc_per_node={world_size}",
                "distributed.cpu_threads_per_rank=1",
            ],
        )
    )
    ctx = init_distributed(job.distributed)
    torch.manual_seed(job.train.seed + ctx.rank + seed_offset)  # DDP starts every rank from rank 0's dense weights
    dmp, opt = shard_model(job, ctx)[:2]
    return job, dmp, opt


def _train(job, dmp, opt, steps: range, rank: int, world_size: int) -> list[float]:
    batches = (movielens_batch(step * world_size + rank, 1, job.features.keys) for step in steps)
    return replica_worker.train_on(dmp, opt, batches)


def _types(dmp) -> dict:
    return {t: ps.sharding_type for mp in dmp.plan.plan.values() for t, ps in mp.items()}


def _sequence_tables(dmp) -> dict:
    return {k: v for k, v in gather_full_state_dict(dmp.state_dict()).items() if any(t in k for t in SEQUENCE_TABLES)}


def losses(rank: int, world_size: int, cases: list, steps: int, groups: int) -> dict:
    """Per case (sharding types; [] the planner's choice): the losses of ``steps`` steps at one
    group and at ``groups`` groups, the types planned, the unsharded sequence tables before and
    after, and for the latter the number of table shards its sync averages on this rank, the
    bytes it all-reduces (``payload``) and the ledger's sync bytes of this rank's group rank."""
    out: dict = {}
    for types in cases:
        for g in (1, groups):
            job, dmp, opt = _build(types, g, world_size)
            before = _sequence_tables(dmp)
            got = {"losses": _train(job, dmp, opt, range(steps), rank, world_size), "type": type(dmp).__name__}
            got["types"], got["tables_before"], got["tables"] = _types(dmp), before, _sequence_tables(dmp)
            if g > 1:
                got["synced"] = sum(len(ws) for ws in dmp._default_ctx.weights_by_dtype.values())
                group_rank = dist.get_rank(dmp._default_ctx.sharding_pg)
                led = run_ledger(dmp, job.data, job.sharding.comms, B, world_size)
                got["sync_bytes"], got["payload"] = led.sync_bytes[group_rank], _sync_payload(dmp)
            out[(tuple(types), g)] = got
    return out


def checkpoints(rank: int, world_size: int, run_dir: str, groups: int, steps: int, types=("row_wise",)) -> dict:
    """``ref``: one group trains 2 x ``steps`` steps (``ref_tables``: its sequence tables after
    ``steps``). ``groups`` groups train ``steps`` (the last one unsynced: ``replica_sync_every``
    raised before it), save (which syncs), and a fresh one-group model (other initial weights)
    loads it and trains steps .. 2 x steps (``to_one``, ``to_one_tables``: what it loaded);
    ``to_groups``: the reverse, a fresh replica-groups model loading a one-group checkpoint."""
    types, out, root = list(types), {}, Path(run_dir)
    job, dmp, opt = _build(types, 1, world_size)
    first = _train(job, dmp, opt, range(steps), rank, world_size)
    one_path = save_checkpoint(root / "one", dmp, opt, step=steps)
    out["ref_tables"] = _sequence_tables(dmp)
    out["ref"] = first + _train(job, dmp, opt, range(steps, 2 * steps), rank, world_size)
    del dmp, opt
    job, dmp, opt = _build(types, groups, world_size)
    out["replicas"] = _train(job, dmp, opt, range(steps - 1), rank, world_size)
    dmp.sync_every = steps + 1  # the last step stays unsynced: the save must sync it
    out["replicas"] += _train(job, dmp, opt, range(steps - 1, steps), rank, world_size)
    out["agree_before_save"] = _replicas_agree(dmp)
    rep_path = save_checkpoint(root / "replicas", dmp, opt, step=steps)
    out["agree_after_save"] = _replicas_agree(dmp)
    del dmp, opt
    for key, path, g in (("to_one", rep_path, 1), ("to_groups", one_path, groups)):
        job, other, opt2 = _build(types, g, world_size, seed_offset=123)
        load_checkpoint(path, other, opt2)
        out[f"{key}_tables"] = _sequence_tables(other)
        out[key] = _train(job, other, opt2, range(steps, 2 * steps), rank, world_size)
        del other, opt2
    return out


def everything(rank: int, world_size: int, run_dir: str, cases: list, steps: int, groups: int) -> dict:
    """One spawn: :func:`losses` over ``cases``, then :func:`checkpoints` (row_wise)."""
    return {
        "losses": losses(rank, world_size, cases, steps, groups),
        "checkpoints": checkpoints(rank, world_size, run_dir, groups, steps // 2),
    }
