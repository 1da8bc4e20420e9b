"""Fault injection for the fault-tolerance tests (off unless $RECSYS_DIST_FAULT is set).

``RECSYS_DIST_FAULT="POINT:STEP[:RANK]"`` kills rank RANK (default 1) with SIGKILL when it
reaches POINT at global step STEP, on the first attempt only (an elastic restart then runs
clean). Points: ``step`` (right after a training step), ``save`` (a checkpoint's shards are
written but the checkpoint is not yet complete), ``raise`` (raise RuntimeError after a step
instead of dying: the other ranks must still exit promptly), ``sigterm`` (SIGTERM to the rank
after a step instead, and to its launcher, as an operator's would reach it: a stream stops
cleanly at its next check), ``disk_full`` (the checkpoint
writer of that step raises ``OSError(ENOSPC)``, as a full disk would), ``metrics_full``
(rank 0's ``metrics.jsonl`` line of that step is cut short and the write raises
``OSError(ENOSPC)``: give RANK 0), ``read_only`` (that line's write raises ``OSError(EROFS)``,
as a file system remounted read-only would: give RANK 0), ``eval`` (a validation of step
STEP is starting), ``scored`` (a stream's partition was scored at step STEP, its line written), ``publish`` (rank 0
is about to publish the checkpoint of step STEP: give RANK 0), ``publish_full`` (rank 0's publish of the
checkpoint of step STEP has written part of its version and raises ``OSError(ENOSPC)``: give RANK 0). ``delay:SECONDS`` makes every rank sleep that long after every step, on every
attempt (a live run slow enough for a test to signal its launcher).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable


def maybe_fault(point: str, step: int, rank: int, partial: Callable[[], object] | None = None) -> None:
    """Inject the fault named by ``$RECSYS_DIST_FAULT`` if it is ``point`` at ``step`` on ``rank``.

    ``partial``: for ``metrics_full``, writes the part of the line that reaches the disk.
    """
    spec = os.environ.get("RECSYS_DIST_FAULT")
    if spec and spec.startswith("delay:") and point == "step":
        time.sleep(float(spec.split(":")[1]))  # every step, every attempt: time to act on a live run
        return
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return
    parts = spec.split(":")
    if point == "step" and parts[0] in ("raise", "sigterm"):
        point = parts[0]
    if parts[0] == point and int(parts[1]) == step and rank == (int(parts[2]) if len(parts) > 2 else 1):
        if point == "raise":
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        if point in ("disk_full", "publish_full"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if point == "metrics_full":
            if partial is not None:
                partial()
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if point == "read_only":
            raise OSError(errno.EROFS, "Read-only file system (injected)")
        if point == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the rank's next check
            launcher = os.environ.get("RECSYS_DIST_LAUNCHER_PID")  # (distributed.env.LAUNCHER_PID_ENV)
            if launcher:  # which stops the ranks as it does for an operator's SIGTERM
                os.kill(int(launcher), signal.SIGTERM)
            return
        os.kill(os.getpid(), signal.SIGKILL)
