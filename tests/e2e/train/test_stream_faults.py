"""data.stream and publish under faults found by adversarial testing: each case a run killed
or fed bad input at one point, then resumed; what must hold afterwards (docs/online.md)."""

from __future__ import annotations

import json

import pytest
import torch

from recsys_dist.serve.export import load
from recsys_dist.serve.publish import load_published, read_manifest
from tests.cli import read_metrics, run_train
from tests.conftest import QUICKSTART
from tests.unit.train.test_stream import CONFIG, NAMES, land, overrides

ONE_RANK = ("distributed.nproc_per_node=1", "train.batch_size=64")  # 10 steps a partition


def _steps(publish_dir) -> list[tuple[int, str, int]]:
    return [(v["version"], v["kind"], v["step"]) for v in read_manifest(publish_dir)["versions"]]


@pytest.mark.slow
def test_a_kill_between_the_last_checkpoint_and_its_publish_is_published_on_resume(tmp_path):
    """Killed right before publishing its last partition: the checkpoint of step 20 is there,
    its version is not. The resume has nothing left to train; it publishes that checkpoint
    (before: it stopped idle, exit 0, leaving version 1 of step 10 as the latest), once."""
    landing, run = tmp_path / "landing", tmp_path / "run"
    for name in NAMES[:2]:
        land(landing, name)
    args = (*overrides(landing), *ONE_RANK)
    env = {"RECSYS_DIST_CACHE": str(tmp_path / "cache")}
    killed = run_train(CONFIG, run, *args, tmp=tmp_path, env={**env, "RECSYS_DIST_FAULT": "publish:20:0"})
    assert killed.returncode != 0
    assert _steps(run / "publish") == [(1, "full", 10)]
    for _ in range(2):  # the second resume finds it published: no third version
        r = run_train(CONFIG, run, *args, "--resume", "auto", tmp=tmp_path, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert _steps(run / "publish") == [(1, "full", 10), (2, "delta", 20)]
    model, version = load_published(run / "publish")
    want = load(run / "checkpoints" / "step_00000020", preprocessing=False).model.state_dict()
    have = model.model.state_dict()
    assert version == 2 and have.keys() == want.keys()
    assert all(torch.equal(have[k], want[k]) for k in want)
    assert [p["partition"] for p in read_metrics(run, "partition")] == NAMES[:2]
    assert json.loads((run / "summary.json").read_text())["partitions"] == NAMES[:2]


@pytest.mark.slow
def test_a_partition_replaced_while_the_run_was_down_inside_it_is_refused(tmp_path):
    """Killed inside a partition (checkpoint after 4 of its 10 batches), which is then replaced
    under the same name: the resume used to go on at batch 4 of the new file (its first 4
    batches never trained, 'rows: 640' claimed, exit 0). Now refused naming both files; with the
    original back it resumes and trains every row once."""
    landing, run = tmp_path / "landing", tmp_path / "run"
    land(landing, NAMES[0])
    path = landing / NAMES[0]
    original = path.read_bytes()
    args = (*overrides(landing), *ONE_RANK)
    env = {"RECSYS_DIST_CACHE": str(tmp_path / "cache")}
    killed = run_train(CONFIG, run, *args, tmp=tmp_path, env={**env, "RECSYS_DIST_FAULT": "step:6:0"})
    assert killed.returncode != 0 and (run / "checkpoints" / "step_00000004").is_dir()
    path.write_bytes(b"".join(original.splitlines(keepends=True)[:320]))
    r = run_train(CONFIG, run, *args, "--resume", "auto", tmp=tmp_path, env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    assert (
        f"partition {NAMES[0]} changed since the checkpoint stopped inside it after 4 global batches: it held "
        f"640 rows ({len(original)} bytes), now 320 rows" in r.stderr
    )
    path.write_bytes(original)
    r = run_train(CONFIG, run, *args, "--resume", "auto", tmp=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rows_trained"] == 640 and summary["steps"] == 10 and summary["partitions"] == NAMES[:1]


@pytest.mark.slow
def test_an_empty_partition_is_consumed_with_a_warning_not_quarantined(tmp_path):
    """docs/online.md: 'An empty partition is consumed with a warning' (it was quarantined as
    malformed: 'the file holds no rows')."""
    landing, run = tmp_path / "landing", tmp_path / "run"
    land(landing, NAMES[0])
    (landing / NAMES[1]).parent.mkdir(parents=True)
    (landing / NAMES[1]).write_bytes(b"")
    (tmp_path / "sentinel").write_text("x")  # in the working directory, which nothing may remove
    r = run_train(CONFIG, run, *overrides(landing), *ONE_RANK, tmp=tmp_path, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"partition {NAMES[1]} holds no rows" in r.stderr and (tmp_path / "sentinel").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["partitions"] == NAMES[:2] and summary["quarantined"] == {} and summary["rows_trained"] == 640
    last = read_metrics(run, "partition")[-1]
    assert (last["partition"], last["rows"], last["steps"], last["step"]) == (NAMES[1], 0, 0, 10)


@pytest.mark.slow
def test_a_resume_on_another_landing_directory_says_its_trained_names_are_skipped(tmp_path):
    """Names are the identity of partitions: a resume with another data.stream.path skips a
    partition of a trained name there (new content or not). It did so without a word."""
    first, second, run = tmp_path / "a", tmp_path / "b", tmp_path / "run"
    land(first, NAMES[0])
    land(second, NAMES[0])
    env = {"RECSYS_DIST_CACHE": str(tmp_path / "cache")}
    assert run_train(CONFIG, run, *overrides(first), *ONE_RANK, tmp=tmp_path, env=env).returncode == 0
    r = run_train(CONFIG, run, *overrides(second), *ONE_RANK, "--resume", "auto", tmp=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        f"data.stream.path is {second.resolve()}; the checkpoint's run read {first.resolve()}. Partitions are named "
        "by their path below it: the 1 name(s) trained there are not trained again here" in r.stderr
    )


@pytest.mark.slow
def test_a_batch_run_killed_before_a_publish_publishes_that_checkpoint_on_resume(tmp_path):
    """The same for `publish.every_n_steps` in a run over data.raw_path: killed between the
    checkpoint of step 8 and its publish, the resume publishes that checkpoint first."""
    run = tmp_path / "run"
    args = (
        "data.num_rows=1000",
        "train.max_steps=12",
        "checkpoint.every_n_steps=4",
        "publish.enabled=true",
        "publish.every_n_steps=4",
        "distributed.nproc_per_node=1",
        "train.batch_size=64",
        "train.progress_bar=false",
    )
    env = {"RECSYS_DIST_CACHE": str(tmp_path / "cache")}
    killed = run_train(QUICKSTART, run, *args, tmp=tmp_path, env={**env, "RECSYS_DIST_FAULT": "publish:8:0"})
    assert killed.returncode != 0 and _steps(run / "publish") == [(1, "full", 4)]
    r = run_train(QUICKSTART, run, *args, "--resume", "auto", tmp=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(run / "publish") == [(1, "full", 4), (2, "delta", 8), (3, "delta", 12)]
