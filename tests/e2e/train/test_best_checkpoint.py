"""Issue 17 "Keeping the best model": train.early_stopping and checkpoint.keep_best.

The slow test trains MovieLens DeepFM (the shipped config, 2 ranks) for 3 epochs, validating
every 25 steps: it overfits after the first epoch (validation logloss best at step 125), stops
after 3 validations without improvement, keeps the best checkpoint although checkpoint.keep is 1,
scores the test split with its weights (restore_best), and `predict best` / `evaluate best` score it. A run killed mid-way and resumed leaves the same
metrics lines, early stop and best checkpoint.
"""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.cli import run_cli
from tests.conftest import ROOT

MOVIELENS = ROOT / "configs" / "movielens_deepfm.yaml"
RUN = [
    "train.epochs=3",
    "train.progress_bar=false",
    "eval.every_n_steps=25",
    "checkpoint.every_n_steps=25",
    "checkpoint.keep=1",
    "checkpoint.keep_best=true",
    "train.early_stopping={metric: logloss, patience: 3}",
]
NOT_TIMINGS = {"split", "step", "epoch", "loss", "lr_scale", "auc", "logloss", "ne", "calibration", "accuracy"}


def lines(run_dir):
    out = []
    for ln in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(ln)
        if m["split"] == "ledger":  # written once per (re)start by design (recsys_dist.distributed.ledger)
            continue
        out.append({k: v for k, v in m.items() if k in NOT_TIMINGS})
    return out


def cli(tmp_path, *args, env=None):
    r = run_cli([str(a) for a in args], tmp_path, env=env)
    return r


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_overfitting_run_keeps_and_scores_its_best_checkpoint(tmp_path):
    ref = tmp_path / "ref"
    r = cli(tmp_path, "train", "--config", MOVIELENS, "--run-dir", ref, *RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((ref / "summary.json").read_text())
    val = [m for m in lines(ref) if m["split"] == "validation"]
    best = min(val, key=lambda m: m["logloss"])
    assert summary["best"]["step"] == best["step"] < summary["steps"] < 3 * 125  # overfit, then stopped
    assert summary["best"]["early_stopped"] and summary["best"]["value"] == pytest.approx(best["logloss"])
    # patience 3: the last 3 validations did not improve, and training stopped at the third
    assert [m["step"] for m in val][-4] == best["step"] and val[-1]["step"] == summary["steps"]
    best_dir = ref / "checkpoints" / f"step_{best['step']:08d}"
    assert (ref / "checkpoints" / "best").read_text().strip() == best_dir.name
    assert sorted(p.name for p in (ref / "checkpoints").glob("step_*")) == sorted(
        {best_dir.name, f"step_{summary['steps']:08d}"}
    )  # keep: 1 deletes every other checkpoint, never the best

    # The converted test and validation splits of the run (manifest-recognised Parquet).
    cache = next((tmp_path / "cache").glob("schema-*/test.parquet")).parent
    outs = {}
    for name, model in (("best", ["best", "--run-dir", ref]), ("dir", [best_dir]), ("latest", [ref])):
        out = tmp_path / f"{name}.parquet"
        r = cli(tmp_path, "predict", *model, "--data", cache / "test.parquet", "--out", out)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[name] = pq.read_table(out).column("logit").to_numpy()
    np.testing.assert_array_equal(outs["best"], outs["dir"])
    # restore_best (early stopping's default): the final checkpoint holds the best weights too,
    # and the summary's test metrics are theirs.
    np.testing.assert_array_equal(outs["best"], outs["latest"])
    assert summary["weights_step"] == best["step"] and summary["validation"]["logloss"] == best["logloss"]
    r = cli(tmp_path, "evaluate", "best", "--run-dir", ref, "--data", cache / "validation.parquet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["logloss"] == pytest.approx(best["logloss"], abs=1e-5)

    # Killed (rank 1, SIGKILL) after step 160, between two checkpoints, then resumed: the same
    # lines, the same early stop, the same best checkpoint.
    run = tmp_path / "killed"
    r = cli(tmp_path, "train", "--config", MOVIELENS, "--run-dir", run, *RUN, env={"RECSYS_DIST_FAULT": "step:160:1"})
    assert r.returncode != 0
    r = cli(tmp_path, "train", "--config", MOVIELENS, "--run-dir", run, "--resume", "auto", *RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert lines(run) == lines(ref)
    got = json.loads((run / "summary.json").read_text())
    assert got["best"] == {**summary["best"], "checkpoint": str(run / "checkpoints" / best_dir.name)}
    assert (run / "checkpoints" / "best").read_text() == (ref / "checkpoints" / "best").read_text()
    # --resume best continues from the best checkpoint (a run that has stopped trains on from there).
    r = cli(tmp_path, "train", "--config", MOVIELENS, "--run-dir", run, "--resume", "best", *RUN)
    assert r.returncode == 0 and f"resumed at step {best['step']}" in r.stdout, r.stderr[-2000:]
