"""Worker of tests/ranks/models/test_mmoe.py (spawned per rank by recsys_dist.testing.run_ranks)."""


def sharded_vs_unsharded(rank: int, world_size: int, config: str) -> float:
    """A multi-task model (MMoE, PLE) through the trainer's sharding path (row-wise and
    table-wise tables): the same [B, T] logits as the unsharded model with the same weights."""
    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from tests.ranks.distributed.equivalence import sharded_and_unsharded
    from tests.unit.models.test_mmoe import _batch

    cfg = load_config(
        config,
        [
            "data.num_embeddings=50",
            "data.categorical_mapping=hash",
            f"distributed.nproc_per_node={world_size}",
            "sharding.sharding_types=[row_wise, table_wise]",
        ],
    )
    got, want = (out[1][1] for out in sharded_and_unsharded(resolve_job(cfg), _batch()))
    assert got.shape == want.shape == (8, 2)
    return (got - want).abs().max().item()


def both_models(rank: int, world_size: int, *configs: str) -> list[float]:
    """``sharded_vs_unsharded`` for each config in one process group (one spawn for several
    models). The process group is created once and reused (``init_distributed`` keeps it)."""
    return [sharded_vs_unsharded(rank, world_size, c) for c in configs]
