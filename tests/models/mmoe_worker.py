"""Worker of tests/models/test_mmoe.py (spawned per rank by recsys_dist.testing.run_ranks)."""

import torch


def sharded_vs_unsharded(rank: int, world_size: int, config: str) -> float:
    """A multi-task model (MMoE, PLE) through the trainer's sharding path (row-wise and
    table-wise tables): the same [B, T] logits as the unsharded model with the same weights."""
    from recsys_dist.config import load_config
    from recsys_dist.distributed import init_distributed
    from recsys_dist.models import build_model
    from recsys_dist.state import load_full_state_dict
    from recsys_dist.trainer import shard_model
    from tests.models.test_mmoe import _batch

    cfg = load_config(
        config,
        [
            "data.num_embeddings=50",
            "data.categorical_mapping=hash",
            f"distributed.nproc_per_node={world_size}",
            "sharding.sharding_types=[row_wise, table_wise]",
        ],
    )
    ctx = init_distributed(cfg)
    torch.manual_seed(0)
    ref = build_model(cfg, torch.device("cpu"), tables_device=torch.device("cpu"))
    dmp, _, _ = shard_model(cfg, ctx)
    load_full_state_dict(dmp.state_dict(), ref.state_dict())
    batch = _batch()
    dmp.eval(), ref.eval()
    got, want = dmp(batch)[1][1], ref(batch)[1][1]
    assert got.shape == want.shape == (8, 2)
    return (got - want).abs().max().item()


def both_models(rank: int, world_size: int, *configs: str) -> list[float]:
    """``sharded_vs_unsharded`` for each config in one process group (one spawn for several
    models). The process group is created once and reused (``init_distributed`` keeps it)."""
    return [sharded_vs_unsharded(rank, world_size, c) for c in configs]
