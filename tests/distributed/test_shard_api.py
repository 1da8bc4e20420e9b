import pytest
import torch

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
    types = ["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"]
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
