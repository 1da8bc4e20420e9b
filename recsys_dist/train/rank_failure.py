"""What ``recsys-dist train`` says when a rank fails: the rank that failed first, a signal
named as such (SIGKILL with the out-of-memory killer's count), and how to continue.

A rank killed by a signal leaves no error of its own; its peers then fail in their next
collective with a lost connection ("Connection reset by peer"), and it is those errors that
the elastic launcher records. So a rank killed by SIGKILL is reported before any rank with a
recorded error, and a rank that only lost its peer prints one line, not its traceback.
"""

from __future__ import annotations

import re
import shlex
import signal
from pathlib import Path

from recsys_dist.checkpoint.meta import latest_checkpoint
from recsys_dist.train import batch_memory

# Errors of a rank whose peer is gone (gloo's TCP pairs, NCCL, the c10d store).
_LOST_PEER = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|Socket closed|ECONNRESET|NCCL communicator was aborted"
    r"|connection to the store was closed|recvValue failed|Connection refused",
    re.IGNORECASE,
)


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another rank's process is gone."""
    return isinstance(err, RuntimeError) and bool(_LOST_PEER.search(str(err)))


def oom_kills() -> dict[str, int]:
    """The kernel's out-of-memory kill counters readable here: this process's cgroup's (v2
    ``memory.events``, v1 ``memory.oom_control``: ``oom_kill``) and the machine's
    (``/proc/vmstat``, ``oom_kill``).
    Compared before and after a run, a rise says the OOM killer killed a process meanwhile."""

    found = {}
    cg = batch_memory.cgroup_memory_dir()
    for name in ("memory.events", "memory.oom_control"):  # cgroup v2, v1
        try:
            found[str(cg / name)] = _counter((cg / name).read_text(), "oom_kill")
            break
        except (OSError, TypeError, ValueError):
            pass
    try:
        found["/proc/vmstat"] = _counter(Path("/proc/vmstat").read_text(), "oom_kill")
    except (OSError, ValueError):
        pass
    return found


def _counter(text: str, key: str) -> int:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise ValueError(key)


def oom_rose(before: dict[str, int], after: dict[str, int]) -> str | None:
    """The first counter file whose OOM kill count rose from ``before`` to ``after``, or None."""
    return next((k for k, v in after.items() if k in before and v > before[k]), None)


def first_killed(failures: dict) -> tuple[int, object] | None:
    """``(rank, failure)`` of the lowest rank among ``failures`` (global rank -> elastic
    ``ProcessFailure``) that SIGKILL ended, or None. SIGKILL comes from outside the rank (the
    OOM killer, a user, a scheduler), so it is the cause, and its peers' errors the effect."""
    killed = sorted((r, f) for r, f in failures.items() if f.exitcode == -signal.SIGKILL)
    return killed[0] if killed else None


def describe(
    rank: int,
    failure,
    message: str,
    *,
    oom_file: str | None,
    job,
    run_dir: Path,
    resume_command: list[str],
) -> str:
    """The launcher's message for a failed rank.

    Args:
        rank: the global rank reported; failure: its elastic ``ProcessFailure``.
        message: its recorded error text (``launch.failure_message``).
        oom_file: the counter file whose OOM kill count rose during the run (:func:`oom_rose`).
        job: the resolved run (``recsys_dist.train.job.Job``: the batch sizes named); run_dir: the run's directory.
        resume_command: ``recsys-dist train ... --resume auto`` as a list of words.
    """
    exitcode = getattr(failure, "exitcode", 0)
    if exitcode >= 0:
        text = f"recsys-dist: training failed on rank {rank}:\n{message}"
        if not _LOST_PEER.search(message):
            return text
        return text + (
            f"\n(rank {rank} lost its connection to another rank: that rank's process ended first, "
            "without recording an error)\n" + _continue(run_dir, resume_command)
        )
    sig = -exitcode
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    batches = (
        f"train.batch_size (now {job.train.batch_size} per rank) or eval.batch_size "
        f"(now {job.eval.batch_size or job.train.batch_size})"
    )
    if sig == signal.SIGKILL and oom_file:
        why = (
            f", by the out-of-memory killer ({oom_file} counted an OOM kill while the ranks ran): the machine "
            f"ran out of memory. Reduce {batches}, or run fewer ranks on this machine"
        )
    elif sig == signal.SIGKILL:
        why = (
            ", likely by the out-of-memory killer (the kernel logs it: dmesg | grep -i 'killed process'), or by "
            f"another process or the job scheduler. If memory ran out, reduce {batches}"
        )
    else:
        why = ""
    verb = "was killed by" if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP) else "died of"
    return (
        f"recsys-dist: rank {rank} {verb} {name} (signal {sig}){why}.\n"
        f"The other ranks were stopped. {_continue(run_dir, resume_command)}"
    )


def _continue(run_dir: Path, resume_command: list[str]) -> str:

    latest = latest_checkpoint(run_dir)
    where = (
        f"from the newest checkpoint ({latest})"
        if latest
        else "(no checkpoint was written yet: it starts again from step 0)"
    )
    return f"Continue {where} with:\n  {shlex.join(resume_command)}"


def resume_command(args, run_dir: Path) -> list[str]:
    """``recsys-dist train`` as it was run, with ``--run-dir`` and ``--resume auto``."""
    words = ["recsys-dist", "train", "--config", str(args.config), "--run-dir", str(run_dir)]
    if getattr(args, "plan", None):
        words += ["--plan", str(args.plan)]
    return [*words, "--resume", "auto", *args.overrides]
