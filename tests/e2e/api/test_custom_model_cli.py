"""A model and a loss outside the package, named by import path, through the whole CLI."""

import json
import os
from pathlib import Path

import pytest

from tests.cli import read_metrics, run_cli

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "examples" / "custom_model" / "config.yaml"
SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"


def cli(args, tmp_path):
    """``recsys-dist ARGS`` run from ``tmp_path``, the example's model importable."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "examples" / "custom_model"), str(ROOT)])}
    r = run_cli(args, tmp_path, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def last(run_dir, split):
    lines = read_metrics(run_dir)
    return [x for x in lines if x["split"] == split][-1]


@pytest.mark.slow
def test_import_path_model_trains_resumes_reshards_exports_and_predicts(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    cli(["train", "--config", CONFIG, "--run-dir", whole, "train.max_steps=30"], tmp_path)
    # 2 ranks to step 20, then resumed on 1 rank with the same global batch (2 x 128).
    cli(
        ["train", "--config", CONFIG, "--run-dir", parts, "train.max_steps=20", "checkpoint.every_n_steps=10"], tmp_path
    )
    cli(
        ["train", "--config", CONFIG, "--run-dir", parts, "--resume", "auto", "train.max_steps=30"]
        + ["distributed.nproc_per_node=1", "train.batch_size=256"],
        tmp_path,
    )
    for split in ("validation", "test"):
        a, b = last(whole, split), last(parts, split)
        assert abs(a["auc"] - b["auc"]) < 1e-5 and abs(a["logloss"] - b["logloss"]) < 1e-5, (split, a, b)
    saved = json.loads((parts / "summary.json").read_text())
    assert saved["resumed_at_step"] == 20 and saved["world_size"] == 1

    cli(["export", parts, "--out", tmp_path / "export"], tmp_path)
    scored = [
        json.loads(cli(["evaluate", src, "--data", SAMPLE], tmp_path).stdout.strip().splitlines()[-1])
        for src in (parts, tmp_path / "export")
    ]
    assert scored[0]["num_examples"] == 10000 and scored[0]["auc"] == scored[1]["auc"]
    cli(["predict", tmp_path / "export", "--data", SAMPLE, "--out", tmp_path / "p.csv"], tmp_path)
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 10001
