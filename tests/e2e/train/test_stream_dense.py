"""Online training (``data.stream``, configs/criteo_online.yaml, 2 ranks) under each dense
strategy, ``fsdp`` (issue 38 item 5) and ``pipeline`` with 2 stages (items 2 and 5): each trains
what ddp trains, publishes a version per partition (a full one, then deltas) whose weights are
ddp's (under pipeline, gathered to rank 0 from the ranks holding each stage), and the server's
scores of the latest version equal ``recsys-dist predict`` on its folded export. One ddp run
serves as the reference for both."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.publish import load_published
from tests.cli import read_metrics, run_cli, run_train
from tests.unit.train.test_stream import CONFIG, NAMES, land, overrides

STRATEGIES = {"fsdp": {}, "pipeline": {"distributed.dense.stages": "2"}}


@pytest.mark.slow
@pytest.mark.timeout(900)  # three 2-rank stream runs
def test_stream_under_fsdp_and_pipeline_trains_as_ddp_and_serves_what_predict_scores(tmp_path):
    landing = tmp_path / "landing"
    for name in NAMES:
        land(landing, name)
    runs = {}
    for strategy, keys in {"ddp": {}, **STRATEGIES}.items():
        run = tmp_path / strategy
        extra = {"distributed.dense.strategy": strategy, "checkpoint.every_n_steps": "5", **keys}
        r = run_train(CONFIG, run, *overrides(landing, **extra), tmp=tmp_path, env={"RECSYS_DIST_CACHE": str(tmp_path)})
        assert r.returncode == 0, r.stderr[-3000:]
        runs[strategy] = run
    losses = {s: [m["loss"] for m in read_metrics(runs[s]) if m["split"] == "train"] for s in runs}
    assert len(losses["ddp"]) >= 9  # 30 steps, a line every 3
    rows = (landing / NAMES[2]).read_text().splitlines()[:50]
    (tmp_path / "rows.txt").write_text("\n".join(rows) + "\n")
    want = load_published(runs["ddp"] / "publish")[0]
    for strategy in STRATEGIES:
        got_losses = losses[strategy]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got_losses, losses["ddp"], strict=True)), strategy
        run = runs[strategy]
        manifest = json.loads((run / "publish" / "manifest.json").read_text())
        assert [(v["version"], v["kind"], v["step"]) for v in manifest["versions"]] == [
            (1, "full", 10),
            (2, "delta", 20),
            (3, "delta", 30),
        ]
        # the published weights are ddp's (to float rounding): an unsharded model, not a rank's shard
        got = load_published(run / "publish")[0].model.state_dict()
        for key, value in want.model.state_dict().items():
            assert got[key].shape == value.shape and (got[key] - value).abs().max().item() < 1e-4, (strategy, key)
        out = tmp_path / f"folded_{strategy}"
        r = run_cli(["export", "--from-publish", str(run / "publish"), "--out", str(out)], tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        scored = tmp_path / f"p_{strategy}.parquet"
        r = run_cli(["predict", str(out), "--data", str(tmp_path / "rows.txt"), "--out", str(scored)], tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        predicted = pq.read_table(scored)["logit"].to_numpy()
        with TestClient(create_app(ModelHolder(open_source(run / "publish"), 0))) as c:
            served = c.post("/score", json={"rows": rows}).json()
        assert served["version"] == 3
        np.testing.assert_allclose(served["logits"], predicted, rtol=0, atol=1e-6)
