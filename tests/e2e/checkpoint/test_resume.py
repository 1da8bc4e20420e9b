"""Checkpoints: exact resume, resharding, elastic restarts, crashes mid-save, bad checkpoints.

Every comparison is on the train-loss lines of metrics.jsonl (logged every 2 steps), which
depend on every weight and every optimizer state: a weight or accumulator that did not
arrive exactly changes them. Tolerance 1e-5 across world sizes (float32 reduction order);
exact equality for the same world size and plan.
"""

import json
import shutil

import pytest

from tests.cli import read_metrics, run_cli, run_train
from tests.conftest import QUICKSTART, ROOT

# 1,600 train rows; global batch 96 drops the remainder so every world size (1, 2, 3) sees
# identical global batches: 16 steps per epoch, 32 in all.
BASE = [
    "data.num_rows=2000",
    "data.remainder=drop",
    "train.epochs=2",
    "train.log_every_n_steps=2",
    "train.progress_bar=false",
    "train.deterministic=true",
]
WS = {
    1: ["distributed.nproc_per_node=1", "train.batch_size=96"],
    2: ["distributed.nproc_per_node=2", "train.batch_size=48"],
    3: ["distributed.nproc_per_node=3", "train.batch_size=32"],
}


def train(tmp_path, run_dir, *extra, env=None, inprocess=None):
    """``inprocess=True``: the run is refused before it trains (see tests.cli.run_cli)."""
    return run_train(QUICKSTART, run_dir, *BASE, *extra, tmp=tmp_path, env=env, inprocess=inprocess)


def losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if m["split"] == "train"}


def assert_same_losses(a, b, tol):
    la, lb = losses(a), losses(b)
    assert sorted(la) == sorted(lb), (sorted(la), sorted(lb))
    for step in la:
        assert la[step] == pytest.approx(lb[step], abs=tol), step


@pytest.mark.slow
def test_exact_resume_and_resharding(tmp_path):
    ref = tmp_path / "ref"
    assert train(tmp_path, ref, *WS[2], "sharding.sharding_types=[table_wise]").returncode == 0

    # Stopped after step 10 (table-wise, 2 ranks), then resumed four ways.
    tw = tmp_path / "tw"
    r = train(
        tmp_path,
        tw,
        *WS[2],
        "sharding.sharding_types=[table_wise]",
        "train.max_steps=10",
        "checkpoint.every_n_steps=4",
        "checkpoint.keep=2",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    kept = sorted(p.name for p in (tw / "checkpoints").iterdir())
    assert kept == ["latest", "step_00000008", "step_00000010"]  # keep=2 pruned step 4
    for name in ("same", "ws1_dp", "ws3_rw"):
        shutil.copytree(tw, tmp_path / name)
    cases = {
        "same": (WS[2], "table_wise", 0.0),
        "ws1_dp": (WS[1], "data_parallel", 1e-5),
        "ws3_rw": (WS[3], "row_wise", 1e-5),
    }
    for name, (ws, st, tol) in cases.items():
        r = train(tmp_path, tmp_path / name, "--resume", "auto", *ws, f"sharding.sharding_types=[{st}]")
        assert r.returncode == 0, r.stderr[-2000:]
        assert_same_losses(ref, tmp_path / name, tol)

    # Data-parallel -> row-wise: the replicated tables' torch optimizer state becomes the
    # fused row-wise state (and the reverse is the ws1_dp case above).
    dp = tmp_path / "dp"
    assert train(tmp_path, dp, *WS[2], "sharding.sharding_types=[data_parallel]", "train.max_steps=10").returncode == 0
    r = train(tmp_path, dp, "--resume", "auto", *WS[2], "sharding.sharding_types=[row_wise]")
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_losses(ref, dp, 1e-5)


@pytest.mark.slow
def test_elastic_restart_after_sigkill_and_crash_mid_save(tmp_path):
    ref = tmp_path / "ref"
    assert train(tmp_path, ref, *WS[2], "checkpoint.every_n_steps=3").returncode == 0
    # Rank 1 is SIGKILLed after step 7; the agent restarts both ranks from step 6.
    run = tmp_path / "killed"
    r = train(
        tmp_path,
        run,
        *WS[2],
        "checkpoint.every_n_steps=3",
        "distributed.max_restarts=1",
        env={"RECSYS_DIST_FAULT": "step:7:1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m["step"] for m in read_metrics(run) if m["split"] == "train"]
    # Every logged step exactly once (lines every 2 steps, plus one at each checkpoint).
    assert steps == sorted(set(range(2, 33, 2)) | set(range(3, 32, 3)))
    assert_same_losses(ref, run, 0.0)

    # Rank 1 dies after writing its shards of the step-6 checkpoint, before it is complete.
    crash = tmp_path / "crash"
    r = train(tmp_path, crash, *WS[2], "checkpoint.every_n_steps=3", env={"RECSYS_DIST_FAULT": "save:6:1"})
    assert r.returncode == 1 and "rank 1 was killed by SIGKILL (signal 9)" in r.stderr
    assert "Continue from the newest checkpoint (" in r.stderr and "step_00000003) with:" in r.stderr
    assert (crash / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    r = train(tmp_path, crash, "--resume", "auto", *WS[2], "checkpoint.every_n_steps=3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_losses(ref, crash, 0.0)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    run = tmp / "run"
    r = train(tmp, run, *WS[1], "train.max_steps=4", "train.epochs=1")
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp, run


def test_checkpoint_from_another_model_config_is_refused(small_run):
    tmp, run = small_run
    r = train(
        tmp,
        tmp / "other",
        *WS[1],
        "--resume",
        str(run / "checkpoints" / "step_00000004"),
        "model.embedding_dim=8",
        "model.dense_arch_layer_sizes=[32,8]",
        inprocess=True,
    )
    assert r.returncode == 1
    assert "written by a different config: model.embedding_dim 16 -> 8" in r.stderr


def test_truncated_or_missing_checkpoint_is_refused(small_run, tmp_path):
    tmp, run = small_run
    broken = tmp_path / "broken"
    shutil.copytree(run / "checkpoints" / "step_00000004", broken)
    (broken / ".metadata").unlink()
    r = train(tmp, tmp_path / "x", *WS[1], "--resume", str(broken), inprocess=True)
    assert r.returncode == 1 and "is incomplete: .metadata missing" in r.stderr
    r = train(tmp, tmp_path / "y", *WS[1], "--resume", str(tmp_path / "nope"), inprocess=True)
    assert r.returncode == 1 and "does not exist" in r.stderr
    r = train(tmp, tmp_path / "z", *WS[1], "--resume", "auto", "train.max_steps=1", "checkpoint.enabled=false")
    assert r.returncode == 0 and "no complete checkpoint" in r.stderr and "starting from scratch" in r.stderr
    meta = json.loads((run / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["step"] == 4 and meta["plan"] and meta["config"]["model"]["embedding_dim"] == 16


def test_export_evaluate_predict_round_trip(small_run, tmp_path):
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    tmp, run = small_run
    out = tmp_path / "export"
    assert run_cli(["export", str(run), "--out", str(out)], tmp).returncode == 0
    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.sparse_arch.embedding_bag_collection.embedding_bags.t_C1.weight"].shape == (10000, 16)
    raw = tmp_path / "rows.txt"
    lines = (ROOT / "datasets/criteo_kaggle/dac_train_first10000.txt").read_text().splitlines()[:300]
    raw.write_text("\n".join(lines) + "\n")
    results = []
    for model in (run, run / "checkpoints" / "step_00000004", out):
        r = run_cli(["evaluate", str(model), "--data", str(raw)], tmp)
        assert r.returncode == 0, r.stderr[-2000:]
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert results[0]["num_examples"] == 300
    assert results[0]["auc"] == results[1]["auc"] == results[2]["auc"]
    preds = tmp_path / "p.parquet"
    assert run_cli(["predict", str(out), "--data", str(raw), "--out", str(preds)], tmp).returncode == 0
    t = pq.read_table(preds)
    assert t.num_rows == 300 and t.column("row").to_pylist() == list(range(300))
    p = t.column("probability").to_numpy()
    assert ((p > 0) & (p < 1)).all()
    r = run_cli(["evaluate", str(tmp_path), "--data", str(raw)], tmp)
    assert r.returncode == 1 and "no model.safetensors and no complete checkpoint" in r.stderr
    # The same rows without their label field (Kaggle's test.txt layout): predict scores them
    # identically and writes null labels; evaluate refuses, saying why.
    unlabelled = tmp_path / "test.txt"
    unlabelled.write_text("\n".join(line.split("\t", 1)[1] for line in lines) + "\n")
    preds2 = tmp_path / "p2.parquet"
    r = run_cli(["predict", str(out), "--data", str(unlabelled), "--out", str(preds2)], tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    t2 = pq.read_table(preds2)
    assert t2.column("label").null_count == 300 and t2.column("logit").equals(t.column("logit"))
    r = run_cli(["evaluate", str(out), "--data", str(unlabelled)], tmp)
    assert r.returncode == 1 and "no label column" in r.stderr and "recsys-dist predict" in r.stderr


def test_resuming_a_finished_run_changes_nothing(small_run):
    tmp, run = small_run
    files = [run / "metrics.jsonl", run / "summary.json", run / "config.yaml"]
    before = [(f.read_text(), f.stat().st_mtime_ns) for f in files]
    r = train(tmp, run, *WS[1], "train.max_steps=4", "train.epochs=1", "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"nothing to train: the run in {run} is already at step 4 (checkpoint step_00000004)" in r.stdout
    assert [(f.read_text(), f.stat().st_mtime_ns) for f in files] == before  # config.yaml not even rewritten
