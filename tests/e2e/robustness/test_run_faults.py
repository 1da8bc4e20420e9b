"""Faults that must never corrupt a run directory (issue 21): restarts without a checkpoint,
a full disk or a read-only file system under metrics.jsonl, a torn last line, two runs in
one directory. One rank, in this process; the 2-rank cases (a rank killed mid-save, the
launcher SIGKILLed or SIGTERMed) are in test_run_faults_ranks.py.

"Equal to an uninterrupted run" compares every metrics.jsonl line but its timings.
"""

import json
import os
import subprocess
import sys

import pytest

from recsys_dist.checkpoint.run_dir import RunDirLocked, lock_run_dir
from tests.conftest import QUICKSTART, ROOT
from tests.unit.robustness.test_run_faults import TOY, keys, lines, train

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
        from recsys_dist.api import Trainer
        from recsys_dist.config import ConfigError
        from recsys_dist.config.loader import load_config

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
