"""HSTU sharded vs unsharded at world sizes 1, 2 and 3: its pooled tables and its history's
EmbeddingCollection table table-wise and row-wise (the 200-row tables split unevenly over 3
ranks), one task and three, and with the time bias and action tokens; the same logits and loss as the unsharded model with the same
weights, within 1e-5. One spawn per world size serves every case. Training on 1 and 2 ranks to
the same losses: tests/ranks/train/test_all_padding_rank.py."""

import pytest

from recsys_dist.testing import run_ranks
from tests.conftest import ROOT
from tests.ranks.models import hstu_worker

CONFIG = str(ROOT / "configs" / "movielens_hstu.yaml")
THREE_TASKS = (
    "data.schema.label=null",
    "data.schema.label_threshold=null",
    "data.schema.labels={like: {column: rating, threshold: 4.0}, love: {column: rating, threshold: 5.0}, "
    "rating: {column: rating, kind: regression}}",
)
EXTRAS = (  # the time bias and rating actions: the raw-valued history_time key rides the same KJT
    "data.schema.history.times=true",
    "model.time_buckets=128",
    "data.schema.history.action=rating",
    "model.action_tokens=true",
)
CASES = [("table_wise",), ("row_wise",), ("row_wise", *THREE_TASKS), ("row_wise", *EXTRAS)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_hstu_sharded_equals_unsharded(world_size):
    for rank, per_case in enumerate(run_ranks(hstu_worker.sharded_vs_unsharded, world_size, CONFIG, CASES)):
        assert set(per_case) == set(CASES)
        for case, (diff, types) in per_case.items():
            assert types["s_history"] == case[0] and set(types.values()) == {case[0]}, (rank, case, types)
            assert diff <= 1e-5, (rank, case, diff)
