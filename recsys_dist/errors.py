"""Every error type of recsys_dist, in one place (each is raised by the module named in its docstring).

Errors that a user can fix carry a message naming the file, row, column or config key and the
fix. ``every_rank = True`` marks an error that every rank raises together, so the command line
reports it once.
"""

import errno


class ConfigError(ValueError):
    """A config file or override is invalid; the message lists every problem found."""


class DataError(ValueError):
    """Raw or converted data is malformed; the message names file, row and column."""


class NoRows(DataError):
    """A raw file holds no data rows: 0 bytes, a header line alone, a Parquet file of 0 rows
    (``recsys_dist.data.convert``; a stream consumes such a partition with a warning)."""


class FileChanging(RuntimeError):
    """A stream's partition file changed (size or modification time) while it was read: a
    writer is still at it (``recsys_dist.data.stream``); it is taken again once it stops changing."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model; the message says which."""


class CheckpointDamaged(CheckpointError):
    """A file of a checkpoint is missing, unreadable, or differs from the size / checksum
    recorded when it was written. ``path``: the checkpoint; ``file``: the damaged file."""


class ExportError(CheckpointError):
    """The model cannot be written as a plain-torch artefact (the message says why)."""


class RunDirLocked(ConfigError):
    """Another live process holds the run directory's lock (another run is writing there)."""

    every_rank = True  # under torchrun every rank raises it (rank 0 took the lock): reported once


class DataChanged(ConfigError):
    """A checkpoint was trained on other training data than the config gives now."""

    every_rank = True  # every rank of a Trainer raises it together: reported once


class UnsafeFile(OSError):
    """A file recsys_dist writes in place (a lock, ``metrics.jsonl``) is a symbolic link, a file
    with other hard links, or not a regular file, or a file it writes is a directory: refused,
    so that nothing it points at is written. An ``OSError`` (errno ``ELOOP``; ``EISDIR`` for a
    directory), so a write's usual error handling reports it; ``filename``: the path; the
    message names the fix (``rm PATH``, ``rm -r PATH`` for a directory). Raised by
    ``recsys_dist.files``."""

    def __init__(self, path, what: str) -> None:
        if what == "a directory":
            text = (
                f"{path} is a directory, where recsys_dist writes a file of that name (it does not create such "
                f"a directory). Remove it (rm -r {path}) and run again"
            )
            code = errno.EISDIR
        else:
            text = (
                f"{path} is {what}; recsys_dist writes only plain files of its own there and never through a "
                f"link, which would overwrite what it points at. Remove it (rm {path}) and run again"
            )
            code = errno.ELOOP  # what O_NOFOLLOW gives on a link
        super().__init__(code, text, str(path))
        self.what = what

    def __reduce__(self):  # pickled to the other ranks (broadcast_result): rebuilt from its own arguments
        return type(self), (self.filename, self.what)

    def __str__(self) -> str:
        return self.strerror


class RunDirError(Exception):
    """A run directory or one of its required files is missing or unreadable."""


class PlanError(RuntimeError):
    """The tables do not fit the topology; the message names them and what to change."""


class RankFailedError(RuntimeError):
    """A rank started by :func:`launch` failed.

    Attributes:
        rank: the first rank that failed (global rank).
        message: its error, ``"ExceptionType: text"``, or the signal that ended it.
        traceback: its traceback as text ("" when the process died without one).
    """

    def __init__(self, rank: int, message: str, traceback: str = "") -> None:
        text = f"rank {rank} failed: {message}"
        if traceback:
            text += f"\n\nrank {rank}'s traceback:\n{traceback.rstrip()}"
        super().__init__(text)
        self.rank, self.message, self.traceback = rank, message, traceback


class MetricsError(RuntimeError):
    """``metrics.jsonl`` cannot be written (disk full, read-only file system) or holds a
    damaged line that is not the last one. Raised on every rank at once when written by
    :meth:`MetricsWriter.write` with ``world_size`` > 1."""

    every_rank = True  # raised on every rank together: the command line reports it once


class WorkerDied(RuntimeError):
    """A worker process ended without answering (killed, out of memory)."""


class BadRequest(DataError):
    """A scoring request of ``recsys-dist serve`` is malformed (not JSON, no rows, a row with
    an unknown column or a value its format rejects); the message names the row and column.
    Raised by ``recsys_dist.serve.request_rows``; the server answers it with HTTP 400."""


# Errors a user can fix (a bad config, data file or checkpoint, a full disk, a diverged run):
# the command line and a rank print them as one line, no traceback (exit code 1, or 2 for a
# ConfigError at the top).
USER_ERRORS = (ConfigError, DataError, CheckpointError, MetricsError, FloatingPointError, UnsafeFile)
