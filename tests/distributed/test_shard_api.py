import pytest
import torch

from recsys_dist.distributed.config import SHARDING_TYPES
from recsys_dist.testing import run_ranks
from tests.distributed import equivalence


@pytest.mark.slow
def test_shard_brings_your_own_model():
    results = run_ranks(
        equivalence.shard_api_forward,
        2,
        {"sharding_types": ["row_wise"], "per_table": {"t2": {"sharding_types": ["table_wise"]}}},
    )
    for r in results:
        assert r["types"] == ["row_wise", "table_wise"]
        assert r["max_diff"] <= 1e-6


def test_shard_rejects_bad_config_before_planning():
    from pydantic import ValidationError

    import recsys_dist

    with pytest.raises(ValidationError, match="sharding_types"):
        recsys_dist.shard(None, {"sharding_types": ["diagonal"]})


@pytest.mark.slow
def test_one_feature_feeding_two_tables():
    types = ["data_parallel", "table_wise", "row_wise", "table_row_wise"]
    for per_type in run_ranks(equivalence.shared_feature_forward, 2, types):
        for st, (keys, diff) in per_type.items():
            assert keys == ["f@a", "f@b"], st
            assert diff <= 1e-6, st


@pytest.mark.slow
def test_embedding_init_does_not_depend_on_sharding():
    types = list(SHARDING_TYPES)
    results = run_ranks(equivalence.init_is_sharding_independent, 2, types)
    (single,) = run_ranks(equivalence.init_is_sharding_independent, 1, ["table_wise"])
    want = single["table_wise"]
    for per_type in results:
        for st, tables in per_type.items():
            for name, t in want.items():
                assert torch.equal(tables[name], t), (st, name)
            assert want["embedding_bags.t0.weight"].abs().max() <= 0.1


def test_one_rank_trainer_skips_ddp_trains_the_same_and_sets_its_threads():
    (res,) = run_ranks(equivalence.one_rank_without_ddp, 1, 4)
    assert not res["is_ddp"] and res["wrapped"][1] == "DistributedDataParallel", res["wrapped"]
    assert res["losses"]["ours"] == res["losses"]["ddp"], res["losses"]
    assert res["dense_diff"] == 0.0
    assert res["threads"] == 3  # distributed.cpu_threads_per_rank


# One spawn per world size serves every check below that needs ranks (spawns are slow).
@pytest.fixture(scope="module")
def shard_ranks():
    cache: dict = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_ranks(equivalence.shard_api_checks, world_size)
        return cache[world_size]

    return get


def _meta_model():
    from torchrec import EmbeddingBagCollection

    return equivalence.Tiny(EmbeddingBagCollection(tables=equivalence.configs(), device=torch.device("meta")))


@pytest.mark.slow
def test_shard_honours_a_fixed_plan(shard_ranks):
    want = {
        t: (p["sharding_type"], p.get("ranks") or ([0, 1] if p["sharding_type"] == "data_parallel" else None))
        for t, p in equivalence.FIXED_PLAN.items()
    }
    for r in shard_ranks(2):
        assert r["fixed_plan"] == want
        assert r["fixed_max_diff"] <= 1e-6
        assert r["rank_outside"] == "ValueError: sharding.fixed_plan.t1.ranks: [2] but the job has 2 rank(s)"


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


@pytest.mark.slow
def test_shard_initial_tables_do_not_depend_on_the_world_size(shard_ranks):
    from torchrec import EmbeddingBagCollection

    from recsys_dist.distributed.tables import init_tables

    # What the trainer's init_tables gives for these tables and seed, on one unsharded collection.
    tables = equivalence.configs()
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    want = ebc.state_dict()
    init_tables(want, tables, equivalence.INIT_SEED, {t.name: t.get_weight_init_max() for t in tables})
    assert sorted(want) == [f"embedding_bags.t{i}.weight" for i in range(3)]
    for world_size in (1, 2, 3):
        for r in shard_ranks(world_size):
            for name, t in want.items():
                assert torch.equal(r["tables"][name], t), (world_size, name)
    for r in shard_ranks(2):
        for name, t in want.items():  # column_wise, table_wise and data_parallel tables too
            assert torch.equal(r["fixed_tables"][name], t), name
        assert max(r["trainer_vs_shard"].values()) == 0.0, r["trainer_vs_shard"]
    (one,) = shard_ranks(1)
    assert not torch.equal(one["torchrec_init"]["embedding_bags.t0.weight"], want["embedding_bags.t0.weight"])


@pytest.mark.slow
def test_shard_refuses_out_of_range_ids(shard_ranks):
    (r,) = shard_ranks(1)
    assert r["ebc_ok"] is None
    assert r["ebc_too_big"].startswith(
        "ValueError: feature 'f_t1': id 50 is out of range for table 't1' of 50 rows (ids must lie in [0, 49])"
    )
    assert r["ebc_negative"].startswith("ValueError: feature 'f_t0': id -1 is out of range for table 't0' of 1000")
    assert r["keyword"].startswith("ValueError: feature 'f_t2': id 31 is out of range for table 't2' of 31 rows")
    assert r["unchecked"] is None
    assert r["shared"].startswith("ValueError: feature 'f': id 70 is out of range for table 'b' of 50 rows")
    pipe = r["pipeline"]
    assert len(pipe["losses"]) == 2, pipe
    assert pipe["error"].startswith("feature 'f_t1': id 50 is out of range for table 't1' of 50 rows"), pipe


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
