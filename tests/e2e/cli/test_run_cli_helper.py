"""tests.cli.run_cli in this process (what a fresh process would print and exit with, and the
pytest process left as it was) and in a forkserver's child (``train``)."""

import logging
import os
import signal
from pathlib import Path

from tests.cli import process_tree, run_cli
from tests.conftest import QUICKSTART


def test_in_process_command_gives_output_and_exit_code_and_restores_the_process(tmp_path):
    import recsys_dist.cli.plan  # noqa: F401  (its first import loads torch, which sets its own variables)

    env, cwd = dict(os.environ), os.getcwd()
    root, torchrec_level = logging.getLogger().level, logging.getLogger("torchrec.distributed.planner").level
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    r = run_cli(
        ["plan", "--config", QUICKSTART, "--world-size", "2", "--device", "cpu", "--json"],
        tmp_path,
        cwd=tmp_path,
        env={"RECSYS_DIST_LOG": "INFO"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"placements"' in r.stdout
    # cmd_plan sets the root logger to ERROR; quiet_third_party sets TorchRec's planner's.
    assert (
        logging.getLogger().level == root and logging.getLogger("torchrec.distributed.planner").level == torchrec_level
    )
    assert dict(os.environ) == env and os.getcwd() == cwd
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers

    r = run_cli(["evaluate"], tmp_path)  # argparse exits 2
    assert r.returncode == 2 and "the following arguments are required" in r.stderr
    r = run_cli(["plan", "--config", tmp_path / "missing.yaml", "--world-size", "2"], tmp_path)
    assert r.returncode == 2 and "missing.yaml" in r.stderr and "Traceback" not in r.stderr
    # A train refused before any rank starts, in this process when asked.
    r = run_cli(["train", "--config", QUICKSTART, "train.batch_size=0"], tmp_path, inprocess=True)
    assert r.returncode == 2 and "train.batch_size" in r.stderr


def test_train_runs_in_a_forkserver_child_with_the_commands_environment(tmp_path):
    import subprocess

    import pytest

    # Refused in the child: the exit code and the message come back.
    r = run_cli(["train", "--config", QUICKSTART, "train.batch_size=0"], tmp_path)
    assert r.returncode == 2 and "train.batch_size" in r.stderr and "Traceback" not in r.stderr
    # The working directory (a relative run directory) and the environment (the cache) are the command's.
    short = ["data.num_rows=1000", "train.max_steps=2", "train.progress_bar=false", "checkpoint.enabled=false"]
    seen = {}

    own = []  # the command's process's command line: what a fork of it shows too

    def below(pid: int) -> bool:  # every process under the command while it runs; never "hung"
        if not own:
            own.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        seen.update({p: cmd for p, (_, cmd) in process_tree(pid).items()})
        return False

    r = run_cli(["train", "--config", QUICKSTART, "--run-dir", "rel", *short], tmp_path, cwd=tmp_path, hung=below)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trained" in r.stdout and (tmp_path / "rel" / "summary.json").exists()
    # Its ranks' forkserver and the 2 ranks: forks of the clean child (their command line is the
    # child's, whichever forkserver this pytest process forked the child from), not a new
    # interpreter that imports RANK_PRELOAD again (tests.cli._rank_server_by_fork).
    forked = [cmd for cmd in seen.values() if "multiprocessing.forkserver" in cmd]
    assert len(forked) >= 3 and all(cmd == own[0] for cmd in forked), (own, seen)
    assert list((tmp_path / "cache").glob("*/manifest.json"))
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli(["train", "--config", QUICKSTART, "--run-dir", tmp_path / "slow", *short], tmp_path, timeout=0.2)
