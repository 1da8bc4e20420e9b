"""Issue 40 item 10 on 2 ranks with row-wise sharded tables: after early stopping the test split,
the best and the final checkpoint all score the best validation's weights, also with checkpoints off.
"""

import json

import pytest

import recsys_dist
from recsys_dist.train.summary import summary_metrics
from tests.unit.train.test_restore_best import OVERFIT, _environment, fit, scored


def two_rank_job(overrides: list, root: str) -> dict:
    """Every rank: the run with sharded tables, the best and final checkpoints scored again,
    and the run with checkpoints off."""
    summary, test, _ = fit(overrides, root + "/run")
    best = summary["best"]["checkpoint"]
    return {
        "summary": summary,
        "test": summary_metrics(test),
        "best": scored(overrides, root + "/eval_best", best),
        "final": scored(overrides, root + "/eval_final", summary["checkpoint"]),
        "memory": fit([*overrides, "checkpoint.enabled=false"], root + "/memory")[0],
    }


@pytest.mark.slow
def test_two_ranks_with_sharded_tables_restore_the_best_weights(tmp_path, monkeypatch):
    _environment(monkeypatch, tmp_path / "cache")  # the ranks inherit it
    overrides = [*OVERFIT, "distributed.nproc_per_node=2", "train.batch_size=32", "sharding.sharding_types=[row_wise]"]
    ours, other = recsys_dist.launch(two_rank_job, 2, overrides, str(tmp_path))
    summary = ours["summary"]
    assert summary["best"]["early_stopped"] and summary["weights_step"] == summary["best"]["step"] < summary["steps"]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert {row["sharding_type"] for row in plan} == {"row_wise"} and all(row["ranks"] == [0, 1] for row in plan)
    for o in (ours, other):
        assert o["test"] == o["best"] == o["final"] == summary["test"]
        assert o["memory"]["test"] == summary["test"] and o["memory"]["weights_step"] == summary["weights_step"]
