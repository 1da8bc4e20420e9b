"""Managed-collision tables end to end (data.categorical_mapping: managed): exact resume,
resharding 2 -> 3 and 2 -> 1 ranks mid-interval, export and predict with the trained
id -> row state, config errors.

Tables of 50 rows for up to 1,600 distinct training ids per feature, so ids are evicted;
eviction every 3 steps, so the step-8 checkpoint holds a pending history (2 steps since the round at step 6);
a TTL of 4 steps, so ids also expire, and the cumulative counters of every train line must match
the uninterrupted run's after each resume.
"""

import json
import shutil

import pytest

from tests.cli import read_metrics, run_cli
from tests.conftest import ROOT
from tests.e2e.checkpoint.test_resume import WS, assert_same_losses, train
from tests.unit.models.test_managed import MANAGED


@pytest.mark.slow
@pytest.mark.timeout(900)  # 5 short training runs, an export and 2 scorings (about 3 min idle)
def test_managed_resume_reshard_export(tmp_path):
    ref = tmp_path / "ref"
    r = train(tmp_path, ref, *WS[2], *MANAGED, "sharding.sharding_types=[table_wise]")
    assert r.returncode == 0, r.stderr[-3000:]
    train_lines = [m for m in read_metrics(ref) if m["split"] == "train"]
    last = train_lines[-1]["managed"]
    assert set(last) == {f"C{i}" for i in range(1, 27)}
    assert any(v["evictions"] > 0 for v in last.values()), last
    assert any(v["evicted_ttl_total"] > 0 for v in last.values()), last
    assert all(v["evicted_total"] == v["evictions"] + v["evicted_ttl_total"] for v in last.values()), last
    assert all(0 <= v["default_share"] <= 1 for v in last.values())

    part = tmp_path / "part"
    r = train(
        tmp_path,
        part,
        *WS[2],
        *MANAGED,
        "sharding.sharding_types=[table_wise]",
        "train.max_steps=8",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("same", "ws1_dp", "ws3_rw"):
        shutil.copytree(part, tmp_path / name)
    cases = {
        "same": (WS[2], "table_wise", 0.0),
        "ws1_dp": (WS[1], "data_parallel", 1e-5),
        "ws3_rw": (WS[3], "row_wise", 1e-5),
    }
    for name, (ws, st, tol) in cases.items():
        r = train(tmp_path, tmp_path / name, "--resume", "auto", *ws, *MANAGED, f"sharding.sharding_types=[{st}]")
        assert r.returncode == 0, r.stderr[-3000:]
        assert_same_losses(ref, tmp_path / name, tol)
        # cumulative counters: exactly the uninterrupted run's, on every train line
        got = _counter_lines(tmp_path / name)
        assert got == _counter_lines(ref), name

    # Export, then evaluate the test split's raw rows: the exported id -> row state maps ids as
    # the run's own (sharded) test evaluation did, and counts the default-row lookups.
    out = tmp_path / "export"
    r = run_cli(["export", str(ref), "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(["export", str(ref), "--out", str(tmp_path / "ts"), "--format", "torchscript"], tmp_path)
    assert r.returncode != 0 and "managed-collision" in r.stderr, r.stderr[-2000:]
    raw = tmp_path / "test_rows.txt"
    lines = (ROOT / "datasets/criteo_kaggle/dac_train_first10000.txt").read_text().splitlines()[1800:2000]
    raw.write_text("\n".join(lines) + "\n")
    want = next(m for m in read_metrics(ref) if m["split"] == "test")
    for model in (ref, out):
        r = run_cli(["evaluate", str(model), "--data", str(raw)], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["num_examples"] == want["num_examples"] == 200
        assert got["auc"] == pytest.approx(want["auc"], abs=1e-6)
        assert got["logloss"] == pytest.approx(want["logloss"], abs=1e-5)
        for f, st in got["managed"].items():
            assert st["default_share"] == pytest.approx(want["managed"][f]["default_share"], abs=1e-6), f


def _counter_lines(run_dir):
    """{step: {feature: cumulative counters}} of a run's train lines."""
    keys = ("admitted_total", "evicted_total", "evicted_ttl_total", "collided_total")
    return {
        m["step"]: {f: [v[k] for k in keys] for f, v in m["managed"].items()}
        for m in read_metrics(run_dir)
        if m["split"] == "train"
    }
