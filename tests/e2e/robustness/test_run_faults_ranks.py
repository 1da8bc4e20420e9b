"""Faults on 2 ranks (issue 21): a rank killed while the first checkpoint is written, the
launcher SIGKILLed or SIGTERMed (its ranks must not outlive it), for ``recsys-dist train``
and ``recsys_dist.launch``. After each, ``--resume auto`` leaves the uninterrupted run's
lines (timings aside). Slow: each run spawns 2 ranks.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import process_tree, run_train
from tests.conftest import QUICKSTART, ROOT
from tests.unit.robustness.test_run_faults import keys, lines

# 1,600 train rows, global batch 64: 25 steps per epoch; 24 steps stay inside the epoch.
TOY2 = [
    "data.num_rows=2000",
    "train.max_steps=24",
    "train.log_every_n_steps=2",
    "checkpoint.every_n_steps=4",
    "train.progress_bar=false",
    "train.deterministic=true",
    "distributed.nproc_per_node=2",
]


def command(run_dir):
    return [
        sys.executable,
        "-m",
        "recsys_dist.cli.main",
        "train",
        "--config",
        str(QUICKSTART),
        "--run-dir",
        str(run_dir),
    ]


def train(tmp, run_dir, *extra, env=None):
    """``recsys-dist train`` in a forkserver's child (``tests.cli``: the command minus its
    imports); the ``python -m recsys_dist.cli.main`` processes are test_ranks_never_outlive_their_launcher's."""
    return run_train(QUICKSTART, run_dir, *TOY2, *extra, tmp=tmp, env=env)


def processes_naming(text: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``text``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state not in ("Z", "X"):
            found.append(int(d.name))
    return found


def below(pid: int) -> dict[int, str]:
    """The live processes started under ``pid`` (children, theirs, ...), each with its command line."""
    return {p: cmd for p, (_, cmd) in process_tree(pid).items()}


def ranks_below(launcher: int) -> list[int]:
    """The ranks of ``launcher``: its processes but the forkserver they fork from (a child of
    the launcher) and multiprocessing's resource tracker."""
    return [p for p, (pp, cmd) in process_tree(launcher).items() if pp != launcher and "resource_tracker" not in cmd]


def gone_within(pids_of, seconds: float) -> list[int]:
    """The processes ``pids_of()`` still finds after ``seconds`` (polled), [] when none."""
    deadline = time.monotonic() + seconds
    while (left := pids_of()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def wait_for_step(run_dir: Path, step: int, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode} before step {step}"
        try:
            if any(s >= step for _, s in keys(run_dir)):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no line at step {step} within {timeout} s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref2")
    r = train(tmp, tmp / "ref")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, lines(tmp / "ref")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_rank_killed_while_the_first_checkpoint_is_written(reference):
    tmp, want = reference
    # Rank 1 dies while the first checkpoint (step 4) is written: the elastic restart has no
    # checkpoint and starts from scratch; step 2's and 4's lines are written once, not twice.
    # (A full disk or a read-only file system under metrics.jsonl on 2 ranks: corpus
    # read_only_file_system_under_metrics_mid_run; with the resume: test_run_faults.py.)
    killed = tmp / "killed_mid_first_save"
    r = train(tmp, killed, "distributed.max_restarts=1", env={"RECSYS_DIST_FAULT": "save:4:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert lines(killed) == want


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_rank_killed_without_restarts_is_named_and_the_run_continues(reference):
    """Rank 1 SIGKILLed at step 6 with no restarts: the launcher printed 'training failed on
    rank 1: Signal 9 (SIGKILL) received by PID ...' (or the survivor's lost connection, with its
    traceback) and no way on. Now: a few lines naming the rank, the signal, the OOM killer as
    the likely cause, the newest checkpoint and the command that continues from it, which
    then finishes with the uninterrupted run's lines."""
    tmp, want = reference
    run = tmp / "killed_no_restarts"
    r = train(tmp, run, env={"RECSYS_DIST_FAULT": "step:6:1"})
    assert r.returncode == 1, r.stderr[-3000:]
    err = r.stderr
    assert "recsys-dist: rank 1 was killed by SIGKILL (signal 9)" in err and "out-of-memory killer" in err, err
    assert f"Continue from the newest checkpoint ({run / 'checkpoints' / 'step_00000004'})" in err, err
    assert f"--run-dir {run} --resume auto" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 6, err
    r = train(tmp, run, "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert lines(run) == want


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_ranks_never_outlive_their_launcher(reference, tmp_path):
    tmp, want = reference
    run = tmp / "launcher_killed"
    # Every step sleeps 0.5 s: the launcher is signalled at steps 6, 14 and 18 of 24, which
    # leaves it at least 3 s (6 steps) to be still running (1 s per step only made it longer).
    env = dict(os.environ, RECSYS_DIST_CACHE=str(tmp / "cache"), RECSYS_DIST_FAULT="delay:0.5")
    cmd = [*command(run), *TOY2]

    # SIGKILL of the launcher: no rank survives it by more than 10 s (they used to be
    # re-parented to PID 1 and train on, pruning checkpoints beside the operator's resume).
    # Output to files, not pipes: a rank that outlived the launcher would hold a pipe open.
    log = open(tmp_path / "killed.log", "w+")
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log, text=True)
    wait_for_step(run, 6, launcher)
    ranks = ranks_below(launcher.pid)
    assert len(ranks) == 2, below(launcher.pid)
    everything = list(below(launcher.pid))  # the ranks, the forkserver, the resource tracker
    launcher.kill()
    launcher.wait()
    assert gone_within(lambda: [p for p in everything if _alive(p)], 10) == []
    assert not (run / "summary.json").exists()

    def resume_then_signal(step: int, sig: signal.Signals) -> str:
        """Resume the run, send ``sig`` to the launcher at ``step``: its stderr, once every process ended."""
        err_path = tmp_path / f"{sig.name}.err"
        with open(err_path, "w") as err_file:
            launcher = subprocess.Popen(
                [*cmd, "--resume", "auto"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err_file, text=True
            )
            wait_for_step(run, step, launcher)
            everything = list(below(launcher.pid))
            assert len(ranks_below(launcher.pid)) == 2, below(launcher.pid)
            launcher.send_signal(sig)
            launcher.wait(timeout=120)
        err = err_path.read_text()
        assert launcher.returncode == 128 + sig, err[-3000:]
        assert f"recsys-dist: stopped by {sig.name}" in err and "Traceback" not in err, err[-3000:]
        assert gone_within(lambda: [p for p in [*everything, *processes_naming(str(run))] if _alive(p)], 10) == []
        return err

    # SIGTERM: exit 143 with one line, no traceback; the ranks are stopped too.
    assert "SignalException" not in resume_then_signal(14, signal.SIGTERM)
    # SIGINT to the launcher alone (not a terminal's Ctrl-C to the group): exit 130 with one
    # line; the ranks it passes the signal on to leave without their KeyboardInterrupt traceback.
    err = resume_then_signal(18, signal.SIGINT)
    assert len(err.strip().splitlines()) <= 2, err[-3000:]

    # Then --resume auto finishes the run: each line once, as in the uninterrupted run.
    r = train(tmp, run, "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert lines(run) == want

    # recsys_dist.launch: the same for a user's function.
    pids = tmp_path / "pids"
    pids.mkdir()
    script = f"import recsys_dist\nfrom tests.e2e.robustness.test_run_faults_ranks import sleeper\nrecsys_dist.launch(sleeper, 2, {str(pids)!r})\n"
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=log)
    deadline = time.monotonic() + 300
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
        assert launcher.poll() is None, log.read()[-3000:]
        time.sleep(0.2)
    ranks = [int(p.name) for p in pids.iterdir()]
    assert len(ranks) == 2
    launcher.kill()
    launcher.wait()
    assert gone_within(lambda: [p for p in ranks if _alive(p)], 10) == []
    log.close()


def sleeper(pid_dir: str) -> None:
    """A rank of a user's job that would run for ever."""
    Path(pid_dir, str(os.getpid())).touch()
    time.sleep(3600)


def ranks_asleep(nproc: int, polls: int = 10):
    """A ``run_cli(hung=...)`` check: True once the command's ``nproc`` ranks (the processes at
    the bottom of its tree, multiprocessing's resource tracker aside) have been in Python's
    ``time.sleep`` (kernel wait channel ``hrtimer_nanosleep``) for ``polls`` checks in a row
    (0.1 s apart). Before the first step a rank's main thread sleeps nowhere else in Python:
    gloo's and the store's C++ retries and the launcher watch thread are not its main thread
    or not this wait; the assertions on the dumped stacks say where they were."""
    streak = 0

    def check(pid: int) -> bool:
        nonlocal streak
        tree = process_tree(pid)
        parents = {pp for pp, _ in tree.values()}
        leaves = [p for p, (_, cmd) in tree.items() if p not in parents and "resource_tracker" not in cmd]
        asleep = len(leaves) == nproc and all(_wait_channel(p) == "hrtimer_nanosleep" for p in leaves)
        streak = streak + 1 if asleep else 0
        return streak >= polls

    return check


def _wait_channel(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_a_command_that_outlives_its_timeout_reports_every_ranks_stacks(tmp_path):
    """A hung ``recsys-dist train`` is reported with where each process waits: the launcher
    and each rank print their Python stacks on SIGUSR1 (``dump_stacks_on_sigusr1``), and the
    test harness sends it before killing them (``tests.cli.HungCommand``)."""
    from tests.cli import HungCommand

    # Hung once both ranks sleep in the injected delay (at most 20 s, as before), not after a
    # fixed 20 s that had to cover their start on a loaded machine.
    with pytest.raises(HungCommand) as hung:
        run_train(
            QUICKSTART,
            tmp_path / "run",
            *TOY2,
            tmp=tmp_path,
            env={"RECSYS_DIST_FAULT": "delay:30"},
            timeout=20,
            hung=ranks_asleep(2),
        )
    err = str(hung.value)
    # the launcher and each rank print "Current thread" once; the ranks wait in the injected delay
    assert err.count("Current thread 0x") == 3, err[-4000:]
    assert err.count("recsys_dist/faults.py") == 2, err[-4000:]


_SIGNAL_AT_START = """
import multiprocessing as mp, os, signal, time
from recsys_dist.train.launch import start_forkserver

start_forkserver()
rank = mp.get_context("forkserver").Process(target=time.sleep, args=(30,))
rank.start()
os.kill(rank.pid, signal.SIGUSR1)  # before any code of ours runs in it
rank.join(3)
print("alive" if rank.is_alive() else f"ended {rank.exitcode}", flush=True)
rank.kill()
"""


def test_sigusr1_at_a_ranks_first_instruction_dumps_its_stacks_and_leaves_it_running():
    """A rank forked from ``recsys-dist train``'s forkserver dumps its stacks on SIGUSR1 even
    before its own code arms the dump (the server armed it: ``recsys_dist.train.forkserver_init``);
    SIGUSR1's default action would end it."""
    r = subprocess.run([sys.executable, "-c", _SIGNAL_AT_START], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "alive", r.stdout + r.stderr[-3000:]
    assert "Current thread 0x" in r.stderr
