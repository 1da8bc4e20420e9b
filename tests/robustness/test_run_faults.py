"""Faults that must never corrupt a run directory (issue 21): restarts without a checkpoint,
a full disk or a read-only file system under metrics.jsonl, a torn last line, two runs in
one directory. One rank, in this process; the 2-rank cases (a rank killed mid-save, the
launcher SIGKILLed or SIGTERMed) are in test_run_faults_ranks.py.

"Equal to an uninterrupted run" compares every metrics.jsonl line but its timings.
"""

import json
import logging
import os
import subprocess
import sys

import pytest

from recsys_dist.checkpoint.run_dir import RunDirLocked, lock_run_dir
from recsys_dist.cli import main as cli
from recsys_dist.train.metrics_writer import MetricsError, MetricsWriter, read_metrics
from tests.conftest import QUICKSTART, ROOT

TOY = [
    "data.num_rows=2000",
    "train.max_steps=8",
    "train.log_every_n_steps=2",
    "checkpoint.every_n_steps=4",
    "train.progress_bar=false",
    "train.deterministic=true",
    "distributed.nproc_per_node=1",
]


def lines(run_dir) -> list[dict]:
    """metrics.jsonl without timings (samples/s and the sampled step breakdown)."""
    return [
        {k: v for k, v in r.items() if k != "samples_per_s" and not k.endswith("_ms")}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def keys(run_dir) -> list[tuple]:
    return [(r["split"], r["step"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def train(run_dir, *extra, env=None, monkeypatch=None) -> int:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    try:
        return cli.main(["train", "--config", str(QUICKSTART), "--run-dir", str(run_dir), *TOY, *extra])
    finally:
        for k in env or {}:
            monkeypatch.delenv(k)


# ------------------------------------------------------------------ metrics.jsonl, no torch


def test_torn_last_line_is_dropped_and_a_torn_middle_line_is_named(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    good = [{"split": "train", "step": s, "epoch": 0, "loss": 0.5} for s in (2, 4, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"split": "train", "st')
    # Other in-process tests may have stopped it propagating, or raised the root's level.
    caplog.set_level(logging.WARNING, logger="recsys_dist")
    logger = logging.getLogger("recsys_dist")
    logger.addHandler(caplog.handler)
    try:
        assert read_metrics(path) == good
    finally:
        logger.removeHandler(caplog.handler)
    assert "dropped the incomplete last line 4" in caplog.text
    w = MetricsWriter(path, enabled=True)
    w.start(4)  # what a resume from step 4 does: the torn line and step 6 go
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in good[:2])
    w.start(0)  # a start from scratch empties it
    assert path.read_text() == ""

    path.write_text(json.dumps(good[0]) + '\n{"split": "tr\n' + json.dumps(good[1]) + "\n")
    with pytest.raises(MetricsError, match=r"metrics.jsonl, line 2: not a metrics record"):
        read_metrics(path)


def test_a_write_that_fails_mid_line_leaves_no_partial_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path, enabled=True)
    w.write(split="train", step=2, epoch=0, loss=0.5)
    before = path.read_bytes()
    monkeypatch.setenv("RECSYS_DIST_FAULT", "metrics_full:4:0")  # 17 bytes reach the disk, then ENOSPC
    with pytest.raises(MetricsError) as err:
        w.write(split="train", step=4, epoch=0, loss=0.4)
    assert "could not be written at step 4 ([Errno 28] No space left on device" in str(err.value)
    assert "--resume auto" in str(err.value)
    assert path.read_bytes() == before
    w.write(split="train", step=6, epoch=0, loss=0.3)  # the fault fires once
    assert [r["step"] for r in read_metrics(path)] == [2, 6]


# ------------------------------------------------------------------ the run directory's lock


def _hold_lock(run_dir):
    """Another process (another run) holding run_dir's lock until killed."""
    code = f"from recsys_dist.checkpoint.run_dir import lock_run_dir; lock = lock_run_dir({str(run_dir)!r}); print('held', flush=True); import time; time.sleep(600)"
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_one_run_per_directory_and_a_dead_holder_leaves_no_lock(tmp_path, capsys, cache_dir):
    run = tmp_path / "run"
    holder = _hold_lock(run)
    try:
        with pytest.raises(RunDirLocked, match=f"is in use by another run \\(pid {holder.pid} on "):
            lock_run_dir(run)
        # The CLI: refused before anything is read or written, fresh or resumed.
        for extra in ([], ["--resume", "auto"]):
            assert train(run, *extra) == 2
            err = capsys.readouterr().err
            assert f"is in use by another run (pid {holder.pid}" in err and "Traceback" not in err
        assert sorted(p.name for p in run.iterdir()) == [".lock"]
        # The library: a Trainer's rank 0 takes the lock too (torchrun has no launcher of ours).
        from recsys_dist.config import ConfigError
        from recsys_dist.config.loader import load_config
        from recsys_dist.train.trainer import Trainer

        with pytest.raises(ConfigError, match="is in use by another run"):
            Trainer(load_config(QUICKSTART, TOY), run)
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead holder's flock: the .lock file left behind blocks nobody.
    with lock_run_dir(run) as lock:
        assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from recsys_dist.checkpoint.run_dir import lock_run_dir; lock_run_dir({str(run)!r})",
            ],
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "RECSYS_DIST_RUN_LOCK"},
            capture_output=True,
            text=True,
        )
        assert other.returncode == 1 and f"in use by another run (pid {os.getpid()}" in other.stderr
    assert lock._fd is None and "RECSYS_DIST_RUN_LOCK" not in os.environ


# ------------------------------------------------------------------ whole runs, one rank


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    mp = pytest.MonkeyPatch()
    mp.setenv("RECSYS_DIST_CACHE", str(tmp / "cache"))
    try:
        assert train(tmp / "ref") == 0
    finally:
        mp.undo()
    return tmp / "ref", tmp / "cache"


@pytest.mark.slow  # seven short trainings
@pytest.mark.timeout(900)
def test_faults_then_resume_auto_leave_the_uninterrupted_lines(reference, tmp_path, monkeypatch, capsys):
    ref, cache = reference
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(cache))
    want = lines(ref)
    # The ledger (bytes per step) once, at the start: a resume on the same plan adds none.
    assert keys(ref) == [("ledger", 0)] + [("train", s) for s in (2, 4, 6, 8)] + [("validation", 8), ("test", 8)]

    # No checkpoint yet (checkpoints off): --resume auto starts from scratch, and the old
    # lines go instead of being followed by a second copy (steps 2, 4, ..., 2, 4, ...).
    scratch = tmp_path / "scratch"
    assert train(scratch, "checkpoint.enabled=false") == 0
    assert train(scratch, "--resume", "auto") == 0
    assert "starting from scratch" in capsys.readouterr().err
    assert lines(scratch) == want

    # The disk fills while step 6's line is written: one clear error, no partial line, the
    # step-4 checkpoint intact; and a torn line a crash left at the end does not stop the resume.
    full = tmp_path / "full"
    assert train(full, env={"RECSYS_DIST_FAULT": "metrics_full:6:0"}, monkeypatch=monkeypatch) == 1
    err = capsys.readouterr().err
    assert "could not be written at step 6 ([Errno 28] No space left on device" in err
    assert "step_00000004" in err and "--resume auto" in err and "Traceback" not in err
    assert keys(full) == [("ledger", 0), ("train", 2), ("train", 4)]
    with (full / "metrics.jsonl").open("a") as f:
        f.write('{"split": "train", "step": 6, "ep')
    assert train(full, "--resume", "auto") == 0
    err = capsys.readouterr().err
    assert "dropped the incomplete last line 4" in err and "Traceback" not in err
    assert lines(full) == want

    # A read-only file system under metrics.jsonl: the same, with EROFS.
    ro = tmp_path / "ro"
    assert train(ro, env={"RECSYS_DIST_FAULT": "read_only:8:0"}, monkeypatch=monkeypatch) == 1
    err = capsys.readouterr().err
    assert "([Errno 30] Read-only file system" in err and "Traceback" not in err
    assert err.count("recsys-dist:") == 1
    assert train(ro, "--resume", "auto") == 0
    assert lines(ro) == want
