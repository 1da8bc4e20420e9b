import pytest
import torch

from recsys_dist.distributed.config import SHARDING_TYPES
from recsys_dist.testing import run_ranks
from tests.ranks.distributed import equivalence


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
