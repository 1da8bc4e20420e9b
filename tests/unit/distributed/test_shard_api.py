import pytest
import torch

from tests.ranks.distributed import equivalence


def test_shard_rejects_bad_config_before_planning():
    from pydantic import ValidationError

    import recsys_dist

    with pytest.raises(ValidationError, match="sharding_types"):
        recsys_dist.shard(None, {"sharding_types": ["diagonal"]})


def _meta_model():
    from torchrec import EmbeddingBagCollection

    return equivalence.Tiny(EmbeddingBagCollection(tables=equivalence.configs(), device=torch.device("meta")))


@pytest.mark.parametrize(
    "sharding, match",
    [
        ({"fixed_plan": {"t0": {"sharding_type": "row_wise"}}}, r"exactly the model's tables .*missing \['t1', 't2'\]"),
        (
            {"fixed_plan": {**equivalence.FIXED_PLAN, "t9": {"sharding_type": "row_wise"}}},
            r"sharding.fixed_plan: .*unknown \['t9'\]",
        ),
        (
            {"fixed_plan": equivalence.FIXED_PLAN, "sharding_types": ["row_wise"], "ddr_gb": 8},
            r"sharding.sharding_types, sharding.ddr_gb: planner settings, without effect under sharding.fixed_plan",
        ),
        (
            {
                "fixed_plan": {
                    **equivalence.FIXED_PLAN,
                    "t2": {"sharding_type": "row_wise", "compute_kernel": "fused_uvm"},
                }
            },
            r"sharding.fixed_plan.t2.compute_kernel: fused_uvm needs a CUDA device",
        ),
    ],
)
def test_shard_refuses_a_bad_fixed_plan(sharding, match):
    import recsys_dist

    with pytest.raises(ValueError, match=match):
        recsys_dist.shard(_meta_model(), sharding, device=torch.device("cpu"))


def test_shard_refuses_batch_size_under_a_fixed_plan():
    import recsys_dist

    with pytest.raises(ValueError, match="batch_size: .*without effect under sharding.fixed_plan"):
        recsys_dist.shard(_meta_model(), {"fixed_plan": equivalence.FIXED_PLAN}, batch_size=64)


def test_shard_refuses_unknown_per_table_names():
    import recsys_dist

    with pytest.raises(
        ValueError, match=r"sharding.per_table: unknown tables \['t_C1'\]; the model's tables are \['t0', 't1', 't2'\]"
    ):
        recsys_dist.shard(_meta_model(), {"per_table": {"t_C1": {"sharding_types": ["row_wise"]}}})


@pytest.mark.parametrize(
    "sharding, kwargs, match",
    [
        ({"hbm_gb": 80}, {}, "sharding.hbm_gb: device memory, which the planner counts on CUDA only"),
        ({"compute_kernels": ["fused_uvm"]}, {}, "sharding.compute_kernels: fused_uvm / fused_uvm_caching need a CUDA"),
        (
            {"per_table": {"t1": {"compute_kernels": ["fused_uvm_caching"]}}},
            {},
            "sharding.per_table.t1.compute_kernels: fused_uvm",
        ),
        ({"cache_load_factor": 0.2}, {}, "sharding.cache_load_factor: only used by the fused_uvm_caching kernel"),
        ({"planner_batch_size": 64}, {"batch_size": 128}, "sharding.planner_batch_size: 64 but batch_size=128"),
    ],
)
def test_shard_refuses_keys_it_cannot_honour(sharding, kwargs, match):
    import recsys_dist

    with pytest.raises(ValueError, match=match):
        recsys_dist.shard(_meta_model(), sharding, device=torch.device("cpu"), **kwargs)


def test_shard_refuses_an_init_range_init_tables_would_ignore():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    import recsys_dist

    t = EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"], weight_init_min=0.0, weight_init_max=0.1
    )
    with pytest.raises(ValueError, match=r"table t: .*asks for \[0, 0.1\]; pass init_tables=False"):
        recsys_dist.shard(EmbeddingBagCollection(tables=[t], device=torch.device("meta")))


@pytest.mark.parametrize(
    "r0,rows,c0,cols,dim,dtype",
    [
        (0, 200_000, 0, 32, 32, torch.float32),  # whole chunks, drawn in place, then a partial one
        (70_000, 100_000, 0, 16, 16, torch.float32),  # a row-wise shard starting mid-chunk
        (5, 7, 0, 8, 8, torch.float32),
        (0, 131_072, 8, 8, 32, torch.float32),  # a column-wise shard
        (1_000, 140_000, 0, 16, 16, torch.float16),  # fp16 weights: drawn in float32, then cast
    ],
)
def test_table_init_is_the_chunk_draws_whatever_the_shard(r0, rows, c0, cols, dim, dtype):
    """init_tables' values of a shard = the rows / columns of full float32 chunks drawn from
    (seed, table, chunk), as a plain reference computes them; bit for bit."""
    from recsys_dist.distributed import tables as state

    R, seed, table, scale = state.ROWS_PER_CHUNK, 7, 3, 0.05
    chunks = []
    for c in range(r0 // R, (r0 + rows - 1) // R + 1):
        g = torch.Generator().manual_seed(((seed * 1_000_003 + table) * 1_000_033 + c) % (1 << 62))
        chunks.append(torch.empty(R, dim).uniform_(-scale, scale, generator=g))
    full = torch.cat(chunks)
    start = r0 - (r0 // R) * R
    want = full[start : start + rows, c0 : c0 + cols].to(dtype)
    got = torch.empty(rows, cols, dtype=dtype)
    state._fill_uniform(got, seed, table, r0, c0, dim, scale)
    assert torch.equal(got, want)
