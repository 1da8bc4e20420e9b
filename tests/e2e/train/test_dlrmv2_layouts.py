"""Issue 38 item 6: configs/criteo_dlrmv2.yaml (MLPerf DLRMv2's dense tower, 16.0M parameters, on
the shipped Criteo sample) trains from ``recsys-dist train`` under each dense layout, ddp, fsdp
and pipeline (2 stages, 1f1b, 4 microbatches), at 2 ranks, and the three train the same model:
equal logged losses (1e-5 relative, the layouts' equality guarantee) and validation numbers.

A few steps of 2,000 rows (the tower has no dropout, so the layouts' losses are comparable)."""

import pytest

from tests.cli import read_metrics, run_train
from tests.conftest import ROOT

CONFIG = ROOT / "configs" / "criteo_dlrmv2.yaml"
STEPS = ["data.num_rows=2000", "train.max_steps=6", "train.log_every_n_steps=2", "checkpoint.enabled=false"]
LAYOUTS = {
    "ddp": [],
    "fsdp": ["distributed.dense.strategy=fsdp"],
    "pipeline": [
        "distributed.dense.strategy=pipeline",
        "distributed.dense.stages=2",
        "distributed.dense.schedule=1f1b",
        "distributed.dense.microbatches=4",
    ],
}


@pytest.mark.slow
@pytest.mark.timeout(900)  # three 2-rank runs of a 16M-parameter tower
def test_criteo_dlrmv2_trains_the_same_under_ddp_fsdp_and_pipeline(tmp_path):
    metrics = {}
    for layout, extra in LAYOUTS.items():
        run = tmp_path / layout
        r = run_train(CONFIG, run, *extra, *STEPS, tmp=tmp_path)
        assert r.returncode == 0, (layout, r.stderr[-3000:])
        metrics[layout] = read_metrics(run)
    want = [m["loss"] for m in metrics["ddp"] if m["split"] == "train"]
    assert len(want) == 3 and all(0.1 < x < 2 for x in want), want  # trains: no blown-up first steps
    val = next(m for m in metrics["ddp"] if m["split"] == "validation")
    for layout in ("fsdp", "pipeline"):
        got = [m["loss"] for m in metrics[layout] if m["split"] == "train"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want, strict=True)), (layout, got, want)
        other = next(m for m in metrics[layout] if m["split"] == "validation")
        assert abs(other["auc"] - val["auc"]) < 1e-5 and abs(other["logloss"] - val["logloss"]) < 1e-5, layout
