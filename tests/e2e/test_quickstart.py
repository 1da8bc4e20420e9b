"""The quickstart end to end through the real CLI, at world size 2 (and under torchrun)."""

import json
import math
import sys

import pytest

from tests.cli import read_metrics, run_cli, run_train
from tests.conftest import QUICKSTART, ROOT

FAST = ["data.num_rows=2000", "train.log_every_n_steps=5"]


def check_run_dir(run_dir, world_size):
    lines = read_metrics(run_dir)
    for split in ("validation", "test"):
        evals = [m for m in lines if m["split"] == split]
        assert evals, f"no {split} line"
        for m in evals:
            assert math.isfinite(m["auc"]) and 0.5 < m["auc"] <= 1.0
            assert math.isfinite(m["logloss"]) and m["logloss"] > 0
            assert m["num_examples"] == 200  # 10% of 2000 rows, padding not counted
            assert {"step", "epoch"} <= m.keys()
    train = [m for m in lines if m["split"] == "train"]
    assert train and all(math.isfinite(m["loss"]) and m["samples_per_s"] > 0 for m in train)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == world_size and summary["rows_trained"] == 1600
    assert "sharding type" in (run_dir / "plan.txt").read_text()
    assert "t_C26" in (run_dir / "plan.txt").read_text()
    assert (run_dir / "config.yaml").is_file()
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / ".metadata").is_file()
    assert len(list(ckpt.glob("*.distcp"))) == world_size


@pytest.mark.slow
def test_quickstart_world_size_2(tmp_path):
    """One spawn, many checks: outputs, mid-epoch eval, step timing, profiler trace, report."""
    run_dir = tmp_path / "run"
    r = run_train(
        QUICKSTART,
        run_dir,
        "--profile",
        *FAST,
        "eval.every_n_steps=10",
        "train.timing_every_n_steps=10",
        "eval.group_feature=C6",
        tmp=tmp_path,
        inprocess=False,  # the real `python -m recsys_dist.cli.main train` (tests.cli forks the others)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation  AUC" in r.stdout and str(run_dir) in r.stdout
    check_run_dir(run_dir, 2)
    lines = read_metrics(run_dir)
    # Switching to eval mid-epoch drops or repeats no training batch: 1,600 rows, 25 steps.
    assert [m["step"] for m in lines if m["split"] == "validation"] == [10, 20, 25]
    # GAUC over the groups of feature C6, from all ranks' predictions.
    assert all(0 < m["gauc"] <= 1 and m["gauc_num_groups"] > 1 for m in lines if m["split"] in ("validation", "test"))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 25
    timed = [m for m in lines if "time_forward_ms" in m]
    assert timed and all(m["time_backward_ms"] > 0 and m["time_input_dist_ms"] >= 0 for m in timed)
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["trace_rank0.json", "trace_rank1.json"]
    # The 2-rank sharded checkpoint, evaluated unsharded in one process, scores the test split
    # exactly as the sharded run did.
    (test_parquet,) = (tmp_path / "cache").glob("criteo-*/test.parquet")
    # (a fresh `python -m recsys_dist.cli.main evaluate`: that path stays covered)
    ev = run_cli(["evaluate", str(run_dir), "--data", str(test_parquet)], tmp_path, inprocess=False)
    assert ev.returncode == 0, ev.stderr[-2000:]
    got = json.loads(ev.stdout.strip().splitlines()[-1])
    (want,) = [m for m in lines if m["split"] == "test"]
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-6) and got["num_examples"] == 200
    assert got["logloss"] == pytest.approx(want["logloss"], abs=1e-6)
    rep = run_cli(["report", str(run_dir)], tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert (run_dir / "loss.png").stat().st_size > 0 and (run_dir / "step_time.png").is_file()
    assert (run_dir / "embedding_memory.png").is_file() and "embedding weights per rank (MiB)" in rep.stdout


@pytest.mark.slow
def test_under_torchrun_uses_its_ranks(tmp_path):
    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = run_train(QUICKSTART, run_dir, *FAST, "distributed.nproc_per_node=1", tmp=tmp_path, launcher=torchrun)
    assert r.returncode == 0, r.stderr[-3000:]
    check_run_dir(run_dir, 2)


def test_bad_config_fails_before_any_rank_starts(tmp_path):
    r = run_train(
        QUICKSTART, tmp_path / "run", "train.batch_size=0", "distributed.nproc_per_node=0", tmp=tmp_path, inprocess=True
    )
    assert r.returncode == 2
    assert "train.batch_size" in r.stderr and "distributed.nproc_per_node" in r.stderr
    assert not (tmp_path / "run").exists()


def test_unwritable_run_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run_train(QUICKSTART, blocker / "run", tmp=tmp_path, inprocess=True)
    assert r.returncode == 2 and "cannot write there" in r.stderr


def test_bad_data_is_reported_before_any_rank_starts(tmp_path):
    lines = (ROOT / "datasets/criteo_kaggle/dac_train_first10000.txt").read_text().splitlines()[:20]
    lines[12] = "2" + lines[12][1:]
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(lines) + "\n")
    r = run_train(QUICKSTART, tmp_path / "run", f"data.raw_path={bad}", tmp=tmp_path, inprocess=True)
    assert r.returncode == 1
    assert "bad.txt, line 13, column label: 2 is not 0 or 1" in r.stderr
    assert "Traceback" not in r.stderr and "[rank" not in r.stderr


@pytest.mark.slow
def test_gzip_input_streaming_auc_and_undefined_auc_is_null(tmp_path):
    import gzip

    lines = (ROOT / "datasets/criteo_kaggle/dac_train_first10000.txt").read_bytes().splitlines(keepends=True)
    gz = tmp_path / "small.txt.gz"
    gz.write_bytes(gzip.compress(b"".join(lines[:10])))
    run_dir = tmp_path / "run"
    r = run_train(QUICKSTART, run_dir, f"data.raw_path={gz}", "eval.auc_buckets=1024", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rows_trained"] == 8  # all 10 rows read: 8 / 1 / 1
    # One validation row: AUC is undefined and written as null, never as NaN.
    assert summary["validation"]["auc"] is None
    assert "NaN" not in (run_dir / "metrics.jsonl").read_text()
    assert all(m["num_buckets"] == 1024 for m in read_metrics(run_dir) if m["split"] in ("validation", "test"))


@pytest.mark.slow
def test_fixed_plan_file_places_tables_and_round_trips(tmp_path):
    rows = [
        {"table": "t_C1", "sharding_type": "row_wise", "compute_kernel": "fused", "ranks": [0, 1]},
        {"table": "t_C2", "sharding_type": "column_wise", "compute_kernel": "fused", "ranks": [1, 0]},
        {"table": "t_C3", "sharding_type": "data_parallel", "compute_kernel": "dense", "ranks": [0, 1]},
        {"table": "t_C4", "sharding_type": "table_row_wise", "compute_kernel": "fused", "ranks": [0, 1]},
    ]
    rows += [
        {"table": f"t_C{i}", "sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [i % 2]}
        for i in range(5, 27)
    ]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(rows))
    run_dir = tmp_path / "run"
    r = run_train(QUICKSTART, run_dir, "--plan", str(plan), *FAST, tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    key = lambda row: row["table"]  # noqa: E731
    got = sorted(json.loads((run_dir / "plan.json").read_text()), key=key)
    assert [{k: g[k] for k in rows[0]} for g in got] == sorted(rows, key=key)
    # fp32 bytes per rank: 26 tables x 10,000 rows x 16 columns x 4 bytes, plus the replica.
    per_rank = [sum(int(g["rank_bytes"].get(str(r), 0)) for g in got) for r in (0, 1)]
    assert sum(per_rank) == (26 + 1) * 10000 * 16 * 4


def test_preprocess_command(tmp_path):
    r = run_cli(["preprocess", "--config", str(QUICKSTART), "--quiet", "data.num_rows=1000"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rows: train 800, validation 100, test 100; skipped 0" in r.stdout


@pytest.mark.slow
def test_avazu_trains_on_two_ranks(tmp_path):
    run_dir = tmp_path / "run"
    r = run_train(
        ROOT / "configs" / "avazu_deepfm.yaml", run_dir, "data.num_rows=3000", "train.progress_bar=false", tmp=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (test,) = read_metrics(run_dir, "test")
    assert 0.5 < test["auc"] <= 1 and test["num_examples"] == 300
    r = run_cli(
        ["train", "--config", str(ROOT / "configs" / "avazu_deepfm.yaml"), "model.name=dlrm"], tmp_path, inprocess=True
    )
    assert r.returncode == 2 and "dlrm needs dense features" in r.stderr
