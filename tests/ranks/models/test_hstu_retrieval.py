"""HSTU retrieval sharded by TorchRec at 1 and 2 ranks, its item table table-wise and
row-wise: HR/NDCG/MRR equal to the unsharded model's with the same weights and equal at both
world sizes (to the bit), and three training steps (fused SGD on the table, DDP + SGD on the
layers) follow the unsharded model's losses and metrics. One spawn per world size."""

import pytest

from recsys_dist.testing import run_ranks
from tests.ranks.models import hstu_retrieval_worker

CASES = ["table_wise", "row_wise"]


def _runs(world_size):
    return {case: run_ranks(hstu_retrieval_worker.sharded_vs_unsharded, world_size, case) for case in CASES}


@pytest.mark.slow
def test_hstu_retrieval_sharded_metrics_exact_at_1_and_2_ranks():
    results = {world: _runs(world) for world in (1, 2)}
    reference = results[1]["table_wise"][0]["before"][1]
    assert reference["users"] == 23 and 0 < reference["mrr"] < 1
    for world, per_case in results.items():
        for case, ranks in per_case.items():
            for rank, out in enumerate(ranks):
                assert out["types"] == [case], (world, case, out["types"])
                sharded, unsharded = out["before"]
                assert sharded == unsharded == reference, (world, case, rank)
                for got, want in out["losses"]:
                    assert abs(got - want) <= 1e-5, (world, case, rank, out["losses"])
                sharded, unsharded = out["after"]
                assert sharded == unsharded, (world, case, rank)
                assert sharded != reference  # the steps moved the weights
