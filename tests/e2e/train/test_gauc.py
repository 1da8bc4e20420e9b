"""GAUC on any one-hot categorical feature: ``eval.group_feature`` validation, and a real run's
GAUC against an independent per-user computation (sklearn) on the run's own predictions."""

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import roc_auc_score

from tests.cli import read_metrics, run_cli
from tests.unit.train.test_gauc import MOVIELENS


def sklearn_gauc(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray) -> tuple[float, int]:
    """Row-weighted mean of per-group ROC AUC over the groups holding both classes."""
    num = den = 0.0
    n_groups = 0
    for g in np.unique(groups):
        mask = groups == g
        y = labels[mask]
        if 0 < y.sum() < len(y):
            num += len(y) * roc_auc_score(y, scores[mask])
            den += len(y)
            n_groups += 1
    return num / den, n_groups


@pytest.mark.slow
def test_movielens_gauc_by_user_matches_sklearn_on_the_runs_predictions(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli(
        [
            "train",
            "--config",
            str(MOVIELENS),
            "--run-dir",
            str(run_dir),
            "eval.group_feature=userId",
            "train.epochs=1",
            "train.progress_bar=false",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = read_metrics(run_dir)
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    for split in ("validation", "test"):
        (m,) = [x for x in lines if x["split"] == split]  # one epoch: one line each, the final model
        assert m["gauc"] is not None and math.isfinite(m["gauc"]) and 0.5 < m["gauc"] < 1, m
        # The converted split (its userId column holds the ids the run grouped by), scored by
        # the run's final checkpoint in one process, row by row in file order.
        data = manifest.parent / f"{split}.parquet"
        preds = tmp_path / f"{split}_preds.parquet"
        p = run_cli(["predict", str(run_dir), "--data", str(data), "--out", str(preds)], tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        rows = pq.read_table(data, columns=["label", "userId"]).to_pydict()
        scored = pq.read_table(preds).to_pydict()
        assert scored["label"] == rows["label"] and len(scored["logit"]) == m["num_examples"]
        want, n_groups = sklearn_gauc(
            np.array(rows["label"]), np.array(scored["logit"], dtype=np.float64), np.array(rows["userId"])
        )
        assert m["gauc_num_groups"] == n_groups > 1
        assert m["gauc"] == pytest.approx(want, abs=1e-5)
