"""configs/movielens_din.yaml end to end: trains on 2 ranks with the history's
EmbeddingCollection table sharded, resumes on 1 rank (twice the per-rank batch) to the same
result as the uninterrupted run, and predicts."""

import json

import pytest

from tests.conftest import ROOT
from tests.test_quickstart import run_cli

DIN = ROOT / "configs" / "movielens_din.yaml"
COMMON = ["train.progress_bar=false", "train.max_steps=40", "checkpoint.every_n_steps=20", "checkpoint.keep=2"]


@pytest.mark.slow
def test_movielens_din_trains_sharded_resumes_resharded_and_predicts(tmp_path):
    full = tmp_path / "full"
    r = run_cli(["train", "--config", str(DIN), "--run-dir", str(full), *COMMON], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = {p["table"]: p for p in json.loads((full / "plan.json").read_text())}
    assert "s_history" in plan and plan["s_history"]["sharding_type"] != "data_parallel"
    want = json.loads((full / "summary.json").read_text())
    assert 0.6 < want["test"]["auc"] < 1

    resumed = tmp_path / "resumed"
    r = run_cli(
        [
            "train",
            "--config",
            str(DIN),
            "--run-dir",
            str(resumed),
            "--resume",
            str(full / "checkpoints" / "step_00000020"),
            "distributed.nproc_per_node=1",
            "train.batch_size=128",
            *COMMON,
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((resumed / "summary.json").read_text())
    for split in ("validation", "test"):
        for k in ("auc", "logloss"):
            assert got[split][k] == pytest.approx(want[split][k], abs=1e-6), (split, k)

    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    preds = tmp_path / "preds.parquet"
    p = run_cli(["predict", str(full), "--data", str(manifest.parent / "test.parquet"), "--out", str(preds)], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
