"""The launcher's report of a failed rank (recsys_dist.train.rank_failure), without starting ranks:
a SIGKILLed rank is named before the peers that only lost their connection to it, the
signal and the out-of-memory killer are named, and the command to continue is printed."""

import json
import signal
from types import SimpleNamespace

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train import rank_failure
from recsys_dist.train.launch import first_failure
from tests.conftest import QUICKSTART

LOST = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:23464: Connection reset by peer."


def _failures(tmp_path):
    """Rank 0 recorded a lost connection (error.json, as torch's @record writes it); rank 1
    was SIGKILLed (no error file), which the elastic agent reports last or first."""
    (tmp_path / "0").mkdir(exist_ok=True)
    (tmp_path / "1").mkdir(exist_ok=True)
    error = {"message": {"message": LOST, "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"}}}
    (tmp_path / "0" / "error.json").write_text(json.dumps(error))
    return {
        0: ProcessFailure(0, 100, 1, str(tmp_path / "0" / "error.json")),
        1: ProcessFailure(1, 101, -signal.SIGKILL, str(tmp_path / "1" / "error.json")),
    }


def test_a_sigkilled_rank_is_named_not_the_peer_that_lost_it(tmp_path):
    """The launcher said 'training failed on rank 0: RuntimeError: ... Connection reset by
    peer' (the survivor's recorded error) when rank 1 had been SIGKILLed."""
    rank, failure = first_failure(ChildFailedError("train", _failures(tmp_path)))
    assert rank == 1 and failure.exitcode == -signal.SIGKILL


def test_a_rank_dead_of_another_signal_is_named_not_the_peer_that_lost_it(tmp_path):
    """A signal other than SIGKILL is named as what the rank died of, with no OOM guess, and
    the survivor's error.json (a lost connection) does not take its place."""
    dead = ProcessFailure(1, 101, -signal.SIGSEGV, str(tmp_path / "1" / "error.json"))
    _failures(tmp_path)  # rank 0's error.json: Connection reset by peer
    rank, failure = first_failure(ChildFailedError("train", {1: dead}))
    assert rank == 1 and failure.exitcode == -signal.SIGSEGV
    job = resolve_job(load_config(QUICKSTART))
    text = rank_failure.describe(
        1, failure, "Signal 11", oom_file=None, job=job, run_dir=tmp_path, resume_command=["x"]
    )
    assert text.startswith("recsys-dist: rank 1 died of SIGSEGV (signal 11).") and "out-of-memory" not in text


def test_the_message_names_the_signal_the_oom_killer_and_the_command_to_continue(tmp_path):
    job = resolve_job(load_config(QUICKSTART))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    args = SimpleNamespace(config="c.yaml", plan=None, overrides=["train.batch_size=1024"])
    command = rank_failure.resume_command(args, run)
    failures = _failures(tmp_path)
    killed = failures[1]
    text = rank_failure.describe(1, killed, "Signal 9", oom_file=None, job=job, run_dir=run, resume_command=command)
    assert text.startswith("recsys-dist: rank 1 was killed by SIGKILL (signal 9), likely by the out-of-memory killer")
    assert "reduce train.batch_size (now 32 per rank) or eval.batch_size" in text
    assert f"recsys-dist train --config c.yaml --run-dir {run} --resume auto train.batch_size=1024" in text
    assert "no checkpoint was written yet" in text
    oom = rank_failure.describe(
        1, killed, "Signal 9", oom_file="/proc/vmstat", job=job, run_dir=run, resume_command=command
    )
    assert "by the out-of-memory killer (/proc/vmstat counted an OOM kill while the ranks ran)" in oom
    assert rank_failure.oom_rose({"/proc/vmstat": 3}, {"/proc/vmstat": 4}) == "/proc/vmstat"
    assert rank_failure.oom_rose({"/proc/vmstat": 3}, {"/proc/vmstat": 3}) is None
    assert all(isinstance(v, int) for v in rank_failure.oom_kills().values())
    survivor = rank_failure.describe(0, failures[0], LOST, oom_file=None, job=job, run_dir=run, resume_command=command)
    assert "lost its connection to another rank" in survivor and "--resume auto" in survivor


def test_cgroup_v1_and_v2_counters_and_limits(tmp_path, monkeypatch):
    """A container's memory cgroup: its OOM kill count and its limit less its use (v1 files
    here, v2 beside), read before the machine's MemAvailable is trusted."""
    from recsys_dist.train import batch_memory

    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (v1 / "memory.limit_in_bytes").write_text(str(1 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(1 << 28))
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("5\n")
    monkeypatch.setattr(batch_memory, "cgroup_memory_dir", lambda: v1)
    assert rank_failure.oom_kills()[str(v1 / "memory.oom_control")] == 3
    free, where = batch_memory.available_memory()  # the cgroup's 768 MiB, unless MemAvailable is less
    assert free <= 3 << 28 and (free < 3 << 28 or where.startswith(f"the memory limit of this process's cgroup ({v1})"))
    monkeypatch.setattr(batch_memory, "cgroup_memory_dir", lambda: v2)
    assert rank_failure.oom_kills()[str(v2 / "memory.events")] == 1
    assert "cgroup" not in (batch_memory.available_memory() or (0, ""))[1]  # no limit: MemAvailable
