"""data.stream: partitions landing while 2 ranks train; each row once across a kill, a resume
and a SIGTERM; progressive validation; quarantine; a version published per partition, served
hot and equal to `predict` on the folded export; managed-collision counters per partition."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from starlette.testclient import TestClient

from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.publish import load_published
from tests.cli import read_metrics, run_cli, run_train
from tests.conftest import ROOT
from tests.unit.train.test_stream import BAD, CONFIG, NAMES, ROWS, TIMING, land, overrides

# Checkpoints every 5 steps, train lines every 3: a stop (at a multiple of 8) can fall inside a window.
EVERY_5 = {"checkpoint.every_n_steps": "5"}


def comparable(run_dir: Path) -> list[dict]:
    """The run's metrics lines without timings, a quarantine error's path below the landing dir."""
    rows = [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir)]
    for r in rows:
        if "error" in r:
            r["error"] = r["error"][r["error"].index(r["partition"]) :]
    return rows


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {what}"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def partition_done(run_dir: Path, name: str):
    def done() -> bool:
        path = run_dir / "metrics.jsonl"
        return path.is_file() and any(
            r.get("split") == "partition" and r.get("partition") == name for r in read_metrics(run_dir)
        )

    return done


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run over every partition, all landed before it starts."""
    tmp = tmp_path_factory.mktemp("stream_ref")
    landing = tmp / "landing"
    for name in [*NAMES, BAD]:
        land(landing, name)
    run = tmp / "run"
    r = run_train(CONFIG, run, *overrides(landing, **EVERY_5), tmp=tmp, env={"RECSYS_DIST_CACHE": str(tmp / "cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, run


@pytest.mark.slow
def test_uninterrupted_stream_trains_every_row_once_and_scores_each_partition_first(reference):
    tmp, run = reference
    summary = json.loads((run / "summary.json").read_text())
    assert summary["partitions"] == NAMES and list(summary["quarantined"]) == [BAD]
    assert summary["rows_trained"] == 3 * ROWS and summary["steps"] == 30 and summary["stopped"] == "idle"
    parts = read_metrics(run, "partition")
    assert [(p["partition"], p["rows"], p["steps"], p["step"]) for p in parts] == [
        (NAMES[0], ROWS, 10, 10),
        (NAMES[1], ROWS, 10, 20),
        (NAMES[2], ROWS, 10, 30),
    ]
    # Progressive validation: each partition scored at the step before its first batch.
    vals = read_metrics(run, "validation")
    assert [(v["partition"], v["step"], v["num_examples"]) for v in vals] == [
        (NAMES[0], 0, ROWS),
        (NAMES[1], 10, ROWS),
        (NAMES[2], 20, ROWS),
    ]
    assert 0.6 < vals[-1]["auc"] < 0.8, vals[-1]
    # Each partition's Parquet is removed once it is trained and checkpointed.
    assert not list((run / "partitions").rglob("*.parquet"))
    (bad,) = read_metrics(run, "quarantine")
    assert bad["partition"] == BAD and "line 3" in bad["error"] and bad["step"] == 20, bad


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_partitions_landing_a_kill_a_resume_and_sigterm_train_every_row_once(reference, tmp_path):
    _, ref = reference
    landing, run = tmp_path / "landing", tmp_path / "run"
    env = dict(os.environ, RECSYS_DIST_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "recsys_dist.cli.main", "train", "--config", str(CONFIG), "--run-dir", str(run)]
    land(landing, NAMES[0])
    waits = {"data.stream.stop_after_idle_seconds": "null", **EVERY_5}
    # 1. Partitions land while it trains; rank 1 is killed at step 17, inside partition 2
    # (its checkpoint of step 15 is the newest).
    log = open(tmp_path / "first.log", "w+")
    proc = subprocess.Popen(
        [*cmd, *overrides(landing, **waits)],
        cwd=ROOT,
        env={**env, "RECSYS_DIST_FAULT": "step:17:1"},
        stdout=log,
        stderr=log,
    )
    wait_for(partition_done(run, NAMES[0]), proc, "partition 1")
    land(landing, NAMES[1])
    land(landing, BAD)
    assert proc.wait(timeout=240) == 1, (tmp_path / "first.log").read_text()[-3000:]
    assert "rank 1 was killed by SIGKILL" in (tmp_path / "first.log").read_text()
    # 2. A resume inside partition 2 with another global batch is refused (its row order).
    args = (*overrides(landing, **EVERY_5), "train.batch_size=16", "--resume", "auto")
    r = run_train(CONFIG, run, *args, tmp=tmp_path, env=env)
    assert r.returncode == 2 and "resume with a global batch of 64" in r.stderr, r.stderr[-3000:]
    assert "[rank" not in r.stderr and "batch_size: 32" in (run / "config.yaml").read_text()  # before any rank
    # 3. Resumed, a SIGTERM (to the launcher, as an operator's) after step 16 stops it there,
    # inside partition 2 and inside a logging window (lines at 15, 18): the window is saved
    # with the checkpoint and goes on in the next run, not cut into a line of its own.
    r = run_train(
        CONFIG,
        run,
        *overrides(landing, **waits),
        "--resume",
        "auto",
        tmp=tmp_path,
        env={**env, "RECSYS_DIST_FAULT": "sigterm:16:0"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stopped"], summary["steps"], summary["rows_trained"]) == ("SIGTERM", 16, 16 * 64), summary
    assert [r["step"] for r in read_metrics(run, "train")][-2:] == [12, 15]  # step 16: still open
    # 4. Resumed with no idle stop: partition 3 lands meanwhile; SIGTERM while it waits ends it.
    log = open(tmp_path / "third.log", "w+")
    proc = subprocess.Popen(
        [*cmd, *overrides(landing, **waits), "--resume", "auto"], cwd=ROOT, env=env, stdout=log, stderr=log
    )
    wait_for(partition_done(run, NAMES[1]), proc, "partition 2")
    land(landing, NAMES[2])
    wait_for(partition_done(run, NAMES[2]), proc, "partition 3")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, (tmp_path / "third.log").read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"] == "SIGTERM" and summary["rows_trained"] == 3 * ROWS, summary
    # Every row once: the same lines, numbers and partitions as the uninterrupted run.
    assert comparable(run) == comparable(ref)
    # 5. Nothing new: a resume trains nothing more and stops when idle.
    r = run_train(CONFIG, run, *overrides(landing, **EVERY_5), "--resume", "auto", tmp=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert comparable(run) == comparable(ref)
    check_published(run, ref, landing, tmp_path)


def check_published(run: Path, ref: Path, landing: Path, tmp: Path) -> None:
    """A full version after partition 1, a delta after each of the others (the kill and the
    resumes change nothing); the fold equals the uninterrupted run's bit for bit; the server's
    scores of the latest version equal `predict` on the folded export."""
    manifest = json.loads((run / "publish" / "manifest.json").read_text())
    assert [(v["version"], v["kind"], v["step"]) for v in manifest["versions"]] == [
        (1, "full", 10),
        (2, "delta", 20),
        (3, "delta", 30),
    ]
    model, version = load_published(run / "publish")
    want, _ = load_published(ref / "publish")
    assert version == 3
    for key, value in want.model.state_dict().items():
        assert torch.equal(model.model.state_dict()[key], value), key
    out = tmp / "folded"
    assert run_cli(["export", "--from-publish", str(run / "publish"), "--out", str(out)], tmp).returncode == 0
    rows = (landing / NAMES[2]).read_text().splitlines()[:50]
    (tmp / "rows.txt").write_text("\n".join(rows) + "\n")
    r = run_cli(["predict", str(out), "--data", str(tmp / "rows.txt"), "--out", str(tmp / "p.parquet")], tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    predicted = pq.read_table(tmp / "p.parquet")["logit"].to_numpy()
    with TestClient(create_app(ModelHolder(open_source(run / "publish"), 0))) as c:
        got = c.post("/score", json={"rows": rows}).json()
        assert got["version"] == 3 and c.get("/health").json()["version"] == 3
    np.testing.assert_allclose(got["logits"], predicted, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_managed_stream_counts_admissions_and_ttl_evictions_per_partition(reference, tmp_path):
    """The partition lines carry what each partition did to the managed tables; ids that go
    cold are evicted after data.managed.ttl_steps, so rows are handed to new ids."""
    tmp, _ = reference
    run = tmp_path / "run"
    managed = {
        "data.categorical_mapping": "managed",
        "data.num_embeddings": "300",
        "data.managed.eviction_interval": "1",
        "data.managed.ttl_steps": "4",
        "publish.enabled": "false",
        "publish.every_partition": "false",
    }
    r = run_train(
        CONFIG, run, *overrides(tmp / "landing", **managed), tmp=tmp_path, env={"RECSYS_DIST_CACHE": str(tmp / "cache")}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    parts = read_metrics(run, "partition")
    assert [p["partition"] for p in parts] == NAMES
    for p in parts:
        c3 = p["managed"]["C3"]
        assert c3["admitted"] > 0 and c3["evicted_ttl"] > 0 and c3["evicted"] >= c3["evicted_ttl"], p
    # The cumulative counters of the last train line are the partitions' sums.
    total = read_metrics(run, "train")[-1]["managed"]["C3"]
    assert total["admitted_total"] == sum(p["managed"]["C3"]["admitted"] for p in parts)
    assert total["evicted_ttl_total"] == sum(p["managed"]["C3"]["evicted_ttl"] for p in parts)
