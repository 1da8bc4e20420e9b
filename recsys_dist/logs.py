"""Logging helpers every layer uses: a handler that writes to the current ``sys.stderr`` (on the
main rank only, and never glued to a progress bar), and the filters that hide third-party
warnings a user cannot act on, each with the reason it is safe to hide.

Once per run, not once per rank: every rank runs the same code on its share of the same data
and checkpoints, so what one rank warns about (a quarantined partition, an undefined validation
metric) every rank warns about. ``recsys_dist``'s log lines are therefore printed by rank 0
only; a record about one rank alone is logged with ``extra=RANK_LOCAL`` and printed by the rank
that logs it. A rank's own failure is printed by that rank (:func:`print_apart`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import sys
import threading
import warnings

from tqdm import tqdm

RANK_LOCAL = {"rank_local": True}  # log(..., extra=RANK_LOCAL): printed by whichever rank logs it
_rank: int | None = None  # this process's rank (set_rank); None: $RANK, else 0


def set_rank(rank: int) -> None:
    """This process is rank ``rank`` of a run (the process group's setup calls it)."""
    global _rank
    _rank = rank


def this_rank() -> int:
    """The rank :func:`set_rank` gave, else ``$RANK`` (a torchrun or ``launch`` rank), else 0."""
    if _rank is not None:
        return _rank
    try:
        return int(os.environ.get("RANK", 0))
    except ValueError:
        return 0


def print_apart(text: str, *, other_bar: bool = False) -> None:
    """Print ``text`` on stderr on lines of its own, never glued to a progress bar.

    A tqdm bar holds the last line of stderr without a newline. This process's bars are cleared
    and redrawn around the text (``tqdm.write``). ``other_bar``: another process may hold a bar
    there (rank 0's bar, seen from the launcher or another rank): the text starts on a fresh
    line: on a terminal the bar's line is cleared first (``\\r`` and erase to its end), in a file
    or a pipe a newline ends it.
    """
    if other_bar:
        text = ("\r\x1b[K" if _isatty(sys.stderr) else "\n") + text
    tqdm.write(text, file=sys.stderr)
    sys.stderr.flush()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (a handler bound to the stream of its creation
    breaks when a caller, a test harness or a notebook, later replaces and closes that stream),
    on rank 0 only unless the record is ``RANK_LOCAL`` (module docstring), through
    :func:`print_apart`."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        if this_rank() != 0 and not getattr(record, "rank_local", False):
            return False  # rank 0 prints it for every rank
        return bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print_apart(self.format(record), other_bar=this_rank() != 0)
        except Exception:  # noqa: BLE001 - logging must never raise; report as logging does
            self.handleError(record)


# Python warnings hidden in every recsys_dist process: (category, message regex, module regex,
# why it is safe to hide). Anything else, a user's own warnings included, is shown.
THIRD_PARTY_WARNINGS = (
    (
        FutureWarning,
        "",
        r"torchrec\.|torch\.distributed\.|fbgemm_gpu\.",
        "deprecated calls inside TorchRec and torch.distributed (broadcast_buffers, all_gather_into_tensor): "
        "theirs to change, not the caller's",
    ),
    (
        FutureWarning,
        "Please use DTensor instead and we are deprecating ShardedTensor",
        "",
        "TorchRec's sharded tables are ShardedTensors; checkpoints must read and write them as such",
    ),
    (
        FutureWarning,
        "HeuristicalStorageReservation is known to cause issues",
        "",
        "sharding.storage_reservation is that percentage reservation; its dry-run dense estimate errs high, "
        "on the safe side",
    ),
    (
        UserWarning,
        "Initializing zero-element tensors is a no-op",
        "",
        "a layer over zero dense features (data without dense columns) has no weights to initialise",
    ),
    (
        UserWarning,
        "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
        "",
        "data_parallel tables on CPU: the gradient comes from TorchRec's autograd.Function around the op "
        "(tests/ranks/distributed/test_sequence_sharding.py checks their updated rows against a reference)",
    ),
)

# Third-party log records hidden: (logger, message regex, why it is safe to hide).
THIRD_PARTY_RECORDS = (
    (
        "root",
        r"Sharding spec not found for ",
        "TorchRec's planner says it of every data_parallel table, which is replicated and has no spec by design",
    ),
    (
        "torchrec.distributed.utils",
        r"Sharding Type is data_parallel, caching params will be ignored",
        "a replicated table has no cache; the fused parameters every sharder gets name one",
    ),
    (
        "torch.fx._symbolic_trace",
        r"is_fx_tracing will return true for both",
        "TorchRec's pipeline calls is_fx_tracing while it traces the model; torch's advice is TorchRec's to take",
    ),
    (
        "torchrec.distributed.train_pipeline.tracing",
        r"Found module ManagedRemap",
        "managed tables remap ids before the lookup, so their input_dist is not pipelined "
        "(docs/managed_collision.md#training-pipeline)",
    ),
    (
        "torchrec.distributed.train_pipeline.utils",
        r"Module '.*' will NOT be pipelined, due to input modifications|Sharded modules were not pipelined",
        "the same managed tables (above), said twice more per rank",
    ),
    (
        "root",
        r"^\[Connection\] 2D (Device Mesh created|sharding_group|replica_group)|^\[2D\] Use inter host all reduce",
        "DMPCollection's mesh and groups under sharding.replica_groups, four lines per rank; the plan and "
        "docs/design/replica_groups.md say which ranks form a group",
    ),
)

# Third-party loggers shown from ERROR up: (logger, why their WARNING lines are not the user's).
THIRD_PARTY_LOGGERS = (
    (
        "torchrec.distributed.planner",
        "notes on how we build its inputs (dry-run dense estimate, constraints recsys_dist.distributed.rules "
        "checks and reports itself)",
    ),
    (
        "torchrec.distributed.comm",
        "'[Connection] intra_group' lines and a pod-size default, per rank, for table_row_wise's groups",
    ),
)


class _DropMatching(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.pattern.search(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not one of ours to drop
            return True


def quiet_third_party() -> None:
    """Hide :data:`THIRD_PARTY_WARNINGS`, :data:`THIRD_PARTY_RECORDS` and the WARNING lines of
    :data:`THIRD_PARTY_LOGGERS` in this process (idempotent); nothing else."""
    for category, message, module, _ in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, pattern, _ in THIRD_PARTY_RECORDS:
        logger = logging.getLogger() if name == "root" else logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
    for name, _ in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def show_warnings_on_main_rank_only() -> None:
    """Python warnings are displayed by rank 0 only (the module docstring's reason); the filters
    still act on every rank, so a warning made an error (``-W error``) is an error on each."""
    if this_rank() != 0:
        warnings.showwarning = _not_shown


def _not_shown(*args, **kwargs) -> None:
    return None


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's Python stack of this process to its stderr and
    leaves it running (``faulthandler``): where each rank of a run that seems stuck is waiting.
    Idempotent; the launcher and every rank call it (Linux and macOS)."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return
    # A forked rank inherits faulthandler's record of the parent's registration but may have
    # reset the signal's handler: register afresh.
    faulthandler.unregister(signal.SIGUSR1)
    for stream in (sys.stderr, sys.__stderr__):  # sys.stderr may be a StringIO (no file descriptor)
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
            continue


def thread_lock_for_progress_bars() -> None:
    """tqdm's bars in this process lock with a thread lock instead of the multiprocessing lock
    it makes by default: one per rank, a semaphore that the resource tracker of a forkserver
    launch reports as "leaked" when the rank is stopped by a signal. Only rank 0 draws bars."""
    tqdm.set_lock(threading.RLock())
