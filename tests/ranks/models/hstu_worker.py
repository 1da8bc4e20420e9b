"""Worker of tests/ranks/models/test_hstu.py (spawned per rank by recsys_dist.testing.run_ranks)."""

from __future__ import annotations

import torch
from torchrec import KeyedJaggedTensor

from recsys_dist.data.loader import CTRBatch

B = 6


def movielens_batch(rank: int, num_tasks: int, keys: list[str] | None = None) -> CTRBatch:
    """This rank's batch in configs/movielens_hstu.yaml's layout (userId, movieId, genres, then
    the history: 0-12 ids per row, so empty histories and uneven padding), ids < 200; with
    ``keys`` (the job's) holding history_action and / or history_time, those too: action ids < 200
    and raw times ``1 + seconds before the row`` (up to ~3 years), one per history event."""
    g = torch.Generator().manual_seed(100 + rank)
    history = torch.randint(0, 13, (B,), generator=g)
    lengths = torch.cat([torch.ones(2 * B, dtype=torch.int64), torch.randint(1, 4, (B,), generator=g), history])
    values = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
    names = ["userId", "movieId", "genres", "history"]
    n = int(history.sum())
    for key in (keys or [])[4:]:
        assert key in ("history_action", "history_time"), key
        extra = torch.randint(0, 200, (n,), generator=g)
        if key == "history_time":
            extra = torch.sort(torch.randint(1, 10**8, (n,), generator=g), descending=True).values
        values, lengths, names = torch.cat([values, extra]), torch.cat([lengths, history]), [*names, key]
    kjt = KeyedJaggedTensor(keys=names, values=values, lengths=lengths, stride=B)
    labels = torch.randint(0, 2, (B, num_tasks), generator=g).float()
    return CTRBatch(torch.zeros(B, 0), kjt, labels.squeeze(1) if num_tasks == 1 else labels, torch.ones(B))


def sharded_and_unsharded(job, batch: CTRBatch) -> tuple:
    """``tests.ranks.distributed.equivalence.sharded_and_unsharded``, also returning the plan:
    (sharded output, unsharded output, {table: sharding type})."""
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.distributed.tables import load_full_state_dict
    from recsys_dist.train.build import build_task, shard_model

    ctx = init_distributed(job.distributed)
    torch.manual_seed(0)
    ref = build_task(job, job.features.on(torch.device("cpu"), torch.device("cpu")))
    dmp, _, _ = shard_model(job, ctx)
    load_full_state_dict(dmp.state_dict(), ref.state_dict())
    dmp.eval(), ref.eval()
    types = {t: ps.sharding_type for mp in dmp.plan.plan.values() for t, ps in mp.items()}
    return dmp(batch), ref(batch), types


def sharded_vs_unsharded(rank: int, world_size: int, config: str, cases: list[tuple[str, ...]]) -> dict:
    """Each case (a sharding type, then extra overrides) of the HSTU config through the
    trainer's sharding path: (largest |sharded - unsharded| of the logits and the loss, the
    sharding type the planner chose for each table). The embeddings start in [-0.5, 0.5] (not
    the config's 0.05) so that a wrong or missing history row moves the logits well past rounding."""
    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config

    out = {}
    for sharding_type, *extra in cases:
        job = resolve_job(
            load_config(
                config,
                [
                    "data.categorical_mapping=hash",
                    "data.num_embeddings=200",
                    "model.embedding_init_scale=0.5",
                    "model.layer_dropout=0.0",
                    f"distributed.nproc_per_node={world_size}",
                    f"sharding.sharding_types=[{sharding_type}]",
                    *extra,
                ],
            )
        )
        num_tasks = len(job.features.tasks)
        (loss, (_, got, _, _)), (want_loss, (_, want, _, _)), types = sharded_and_unsharded(
            job, movielens_batch(rank, num_tasks, job.features.keys)
        )
        assert got.shape == want.shape and got.numel() == B * num_tasks, (got.shape, want.shape)
        diff = max((got - want).abs().max().item(), (loss - want_loss).abs().max().item())
        out[(sharding_type, *extra)] = (diff, types)
    return out
