"""One rank of ``recsys-dist train``, and the launcher's side of starting them.

``recsys-dist train`` resolves the run once (:class:`~recsys_dist.train.job.Job`), checks it,
converts the data, then either trains in its own process or starts
``distributed.nproc_per_node`` ranks with :func:`launch_ranks`. Each rank runs
:func:`rank_main` on that Job (inherited by a forked rank, pickled to a spawned one): the
ranks never parse the command line or validate the config again. Under torchrun (no launcher
of ours) every process runs ``recsys-dist train`` itself and trains through :func:`train_rank`.

Process exits (docs/design/0011-one-resolved-job-and-the-rank-entry.md): a rank that failed
leaves with ``os._exit`` right after printing, so that it is the one the elastic agent sees
fail first and no interpreter finalisation (a native thread torn down there aborted ~1 run in
40) runs after its report.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.dcp import latest_checkpoint
from recsys_dist.checkpoint.meta import read_meta
from recsys_dist.data.loader import steps_per_epoch
from recsys_dist.distributed.env import die_with_launcher
from recsys_dist.errors import USER_ERRORS
from recsys_dist.logs import (
    print_apart,
    quiet_third_party,
    show_warnings_on_main_rank_only,
    this_rank,
    thread_lock_for_progress_bars,
)
from recsys_dist.train import rank_failure
from recsys_dist.train.job import Job
from recsys_dist.train.launch import failure_message, first_failure, launch_workers
from recsys_dist.train.observe import EARLIER_PHASES_ENV, RUN_START_ENV, process_start_time
from recsys_dist.train.run import train

LOST_PEER_GRACE_S = 5.0  # how long a rank that lost its peer waits before it exits (rank_main)


@dataclass(frozen=True)
class RankRun:
    """What a rank of ``recsys-dist train`` needs besides the Job.

    Attributes:
        run_dir: the run directory. profile: write a profiler trace (``RUN_DIR/profile``).
        resume: the checkpoint to continue from (resolved by the launcher), ``"auto"``, or None.
        resume_on_new_data: ``--resume-on-new-data``.
        launched: started by our launcher (which reports an error every rank raised, and the
            summary), not by torchrun.
        callbacks: the Trainer's callbacks (``recsys_dist.train.trainer.Callback``; the command
            line's publishing one), copied into each rank.
    """

    run_dir: Path
    profile: bool = False
    resume: Path | str | None = None
    resume_on_new_data: bool = False
    launched: bool = True
    callbacks: tuple = ()


def train_rank(job: Job, run: RankRun) -> tuple[int, dict | None]:
    """Train one rank of the job; (exit code, the summary or None). A user error is printed
    as one line (an error every rank raised together: once, by the launcher or by rank 0) and
    gives code 1; any other exception propagates (recorded in the rank's error.json)."""
    resume = run.resume
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        # The elastic agent restarted the group after a failure: continue from the newest
        # intact checkpoint of this run, if one was written.
        resume = "auto" if latest_checkpoint(run.run_dir) is not None else resume
    profile = run.run_dir / "profile" if run.profile else None
    try:
        summary = record(_train_or_echo)(job, run.run_dir, profile, resume, run.resume_on_new_data, run.callbacks)
        if isinstance(summary, BaseException):  # another rank's failure (_train_or_echo)
            # Let the launcher see that rank's end first (it stops this one meanwhile): it reports
            # the first rank it sees exit, and this one recorded nothing.
            time.sleep(LOST_PEER_GRACE_S)
            raise summary
    except USER_ERRORS as err:
        # Recorded for the launcher's report already; a traceback would only bury the message.
        rank = int(os.environ.get("RANK", 0))
        if not (getattr(err, "every_rank", False) and (run.launched or rank != 0)):
            print_apart(f"recsys-dist [rank {rank}]: {err}", other_bar=rank != 0)
        sys.stderr.flush()
        return 1, None
    # Everything is written and the process group is gone. The callers leave without
    # interpreter finalisation (module docstring).
    sys.stdout.flush()
    sys.stderr.flush()
    return 0, summary


def _train_or_echo(*args):
    """``train(*args)``; an error that another rank raised first and every rank raises with it
    (its ``origin_rank``, e.g. rank 0's failed publish) is returned here, not raised, so that
    only the rank that failed records it (error.json) and the launcher names that rank."""
    try:
        return train(*args)
    except USER_ERRORS as err:
        if getattr(err, "origin_rank", None) not in (None, int(os.environ.get("RANK", 0))):
            return err
        raise


def _rank_code(job: Job, run: RankRun) -> int:
    quiet_third_party()  # a spawned rank starts with the default filters
    show_warnings_on_main_rank_only()  # every rank would print the same ones
    thread_lock_for_progress_bars()
    die_with_launcher()  # a rank never outlives its launcher
    code, summary = train_rank(job, run)
    if summary is not None and summary.get("stopped") == "SIGTERM":
        # The agent that sent SIGTERM is closing the ranks: a rank that returned would wait for
        # its "finished" event until the agent's SIGKILL (30 s); this one has saved, and leaves.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return code


def rank_main(job: Job, run: RankRun) -> int:
    """What every rank of :func:`launch_ranks` runs.

    A failed rank leaves with its exit code (the agent reports it with the error the rank
    recorded); a finished one returns 0 to the agent."""
    # A forked rank inherits the launcher's handlers (the agent's SIGTERM -> SignalException).
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = record(_rank_code)(job, run)  # an exception is recorded (error.json) for the launcher
    except BaseException as err:  # noqa: BLE001 - leave now, so this rank is the one the launcher sees fail first
        if isinstance(err, KeyboardInterrupt):  # the launcher's SIGINT, passed on: it says so in one line
            os._exit(130)
        if rank_failure.lost_peer(err):  # the effect of another rank's end, which the launcher reports: one line
            # Wait for the launcher to see that rank's end first (it stops this one meanwhile):
            # the elastic agent reports one failed rank, whichever it finds first, and a rank
            # killed by a signal records no error, so this rank's error would hide the cause.
            time.sleep(LOST_PEER_GRACE_S)
            first_line = str(err).splitlines()[0] if str(err) else ""
            rank = os.environ.get("RANK", "?")
            print_apart(
                f"recsys-dist: rank {rank} stopped: it lost its connection to another rank ({first_line})",
                other_bar=rank != "0",
            )
        else:
            print_apart(traceback.format_exc().rstrip(), other_bar=this_rank() != 0)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    return 0


class Stopped(BaseException):
    """SIGTERM / SIGINT / SIGHUP reached the launcher (a BaseException, as KeyboardInterrupt is,
    so no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def signals_stop() -> Iterator[None]:
    """SIGTERM / SIGINT / SIGHUP raise :class:`Stopped` here (the one-rank run in this process)."""

    def stop(signum, frame):
        raise Stopped(signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def run_clock(data_seconds: float) -> Iterator[None]:
    """The ranks' wall-time split (summary.json) starts at this command's start and counts its
    data preparation: both travel in the environment, which the ranks inherit."""
    saved = {k: os.environ.get(k) for k in (RUN_START_ENV, EARLIER_PHASES_ENV)}
    os.environ[RUN_START_ENV] = repr(process_start_time())
    os.environ[EARLIER_PHASES_ENV] = json.dumps({"data": data_seconds})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch_ranks(job: Job, run: RankRun, start_method: str, resume_command: list[str]) -> dict | None:
    """Start ``distributed.nproc_per_node`` ranks of :func:`rank_main` on ``job``; the run's
    summary, or None after printing the first failing rank's error (``resume_command``: how
    to continue, named in it).

    Raises:
        Stopped: SIGTERM / SIGINT / SIGHUP reached this process (the ranks are stopped).
    """
    # The elastic agent's own handlers turn SIGTERM / SIGINT / SIGHUP into SignalException
    # once the ranks run; it stops them (SIGTERM, then SIGKILL) before raising it.
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    oom_before = rank_failure.oom_kills()
    try:
        with signals_stop():
            launch_workers(
                rank_main, (job, run), job.distributed.nproc_per_node, job.distributed.max_restarts, start_method
            )
    except SignalException as err:
        raise Stopped(int(err.sigval)) from None
    except ChildFailedError as err:
        rank, first = first_failure(err)
        text = rank_failure.describe(
            rank,
            first,
            failure_message(first),
            oom_file=rank_failure.oom_rose(oom_before, rank_failure.oom_kills()),
            job=job,
            run_dir=run.run_dir,
            resume_command=resume_command,
        )
        print_apart(text, other_bar=job.train.progress_bar)  # a killed rank 0 leaves its bar mid-line
        return None
    return run_dirs.read_summary(run.run_dir)


def nothing_to_train(job: Job, resume: Path, run_dir: Path, resume_on_new_data: bool) -> str | None:
    """What the launcher says when the checkpoint ``resume`` is already at the run's last step
    over the converted data ``job.prepared``, or None when there is something left to train.

    Raises:
        DataChanged: the checkpoint was trained on other data and not ``resume_on_new_data``.
    """
    prepared, n = job.prepared, job.distributed.nproc_per_node
    per_epoch = steps_per_epoch(prepared.rows["train"], job.train.batch_size, n, job.data.remainder)
    meta = read_meta(resume)
    identity = run_dirs.data_identity(prepared.directory, job.data.raw_path)
    new_data = run_dirs.check_same_data(resume, meta, identity, resume_on_new_data, "--resume-on-new-data")
    offset = run_dirs.resume_position(meta, per_epoch, new_data, job.train.batch_size * n)[1]
    total = job.train.total_steps(per_epoch, offset)
    step = run_dirs.checkpoint_step(resume)
    return run_dirs.nothing_to_train(run_dir, resume, step, total) if step >= total else None


def stopped_message(stop: Stopped, run_dir: Path) -> str:
    """What the launcher prints when a signal stopped the run."""
    return (
        f"recsys-dist: stopped by {signal.Signals(stop.signum).name}; every rank was stopped. Continue with "
        f"--resume auto --run-dir {run_dir} (from its newest complete checkpoint)"
    )
