"""Partitions that land in a directory: which are there, which are complete, and each one
converted on its own.

``data.stream`` (docs/online.md) trains on the files that appear under ``stream.path``. A
file is *landed* once it matches ``stream.pattern`` and its name does not start with ``.``
or ``_`` (the lake convention: a writer fills ``.part.tmp`` or ``_temporary/...`` and renames
the finished file into place, atomically; ``_SUCCESS`` markers are not data). Partitions are
named by their path below ``stream.path`` (``day=3/hour=07/part-0.txt``) and taken in the
sort order of those names.

A landed file is *ready* (:func:`ready`) once it has stopped changing: its modification time
is ``stream.min_file_age_seconds`` old, or, with ``stream.marker``, its directory holds the
marker. A file is known by its size and modification time (:func:`scan`); one that changes
while it is converted is not taken (:class:`~recsys_dist.errors.FileChanging`).

Each partition is converted like a batch run's raw file (same format, same mapping), as one
split: every row is training data, into the run's own directory (a stream would otherwise
fill the shared conversion cache without end); the trainer removes a partition's Parquet once
it has trained it and saved the checkpoint that records it. Hash and managed mapping only: both map a
value the same way in every partition (a vocabulary would need all the data up front).
"""

from __future__ import annotations

import json
import shutil
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path

from recsys_dist.data.config import DataConfig, StreamConfig
from recsys_dist.data.convert import PreparedData, entry_path, prepare
from recsys_dist.data.resolve import conversion_spec
from recsys_dist.errors import DataError, FileChanging, NoRows


def landed(stream: StreamConfig) -> list[str]:
    """Names (posix paths below ``stream.path``) of the landed partition files, sorted.

    Raises:
        DataError: ``stream.path`` is not a readable directory.
    """
    return list(scan(stream))


def scan(stream: StreamConfig) -> dict[str, list[int]]:
    """The landed partition files, sorted by name: name -> ``[size in bytes, mtime in ns]``
    (what a partition is known by; a file gone between the listing and its stat is left out).

    Raises:
        DataError: ``stream.path`` is not a readable directory.
    """
    root = Path(stream.path)
    if not root.is_dir():
        raise DataError(f"data.stream.path: {root} is not a directory (it was, when the run started)")
    found = {}
    for f in root.glob(stream.pattern):
        rel = f.relative_to(root)
        if any(part.startswith((".", "_")) for part in rel.parts):
            continue
        try:
            st = f.stat()
        except OSError:  # removed (or renamed) since the listing
            continue
        if stat.S_ISREG(st.st_mode):
            found[rel.as_posix()] = [st.st_size, st.st_mtime_ns]
    return dict(sorted(found.items()))


def ready(stream: StreamConfig, name: str, file_id: list[int], now: float | None = None) -> bool:
    """Whether the landed file ``name`` (``file_id`` from :func:`scan`) may be taken: with
    ``stream.marker``, once its directory holds the marker; else once it has not been
    modified for ``stream.min_file_age_seconds`` (``now``: seconds since the epoch, default the
    current time; a modification time in the future waits)."""
    if stream.marker is not None:
        return (Path(stream.path) / name).parent.joinpath(stream.marker).is_file()
    now = time.time() if now is None else now
    return now - file_id[1] / 1e9 >= stream.min_file_age_seconds


def not_ready_reason(stream: StreamConfig) -> str:
    """Why a landed file is not taken yet (for the log)."""
    if stream.marker is not None:
        return f"its directory has no {stream.marker} yet (data.stream.marker)"
    return f"it was modified less than {stream.min_file_age_seconds:g} s ago (data.stream.min_file_age_seconds)"


@dataclass
class Partition:
    """One partition converted (:func:`convert_partition`).

    Attributes:
        prepared: the conversion (``train`` holds every row), or None for a file without rows.
        rows: rows converted. file_id: ``[size, mtime_ns]`` of the file that was read.
        skipped: bad rows left out (``data.on_bad_row: skip``).
        first_skipped: the first of them, ``"line N: why"`` (None when none was).
        histories: under ``data.stream.histories: carry``, the users' history state after this
            partition (``formats.history.UserHistory.state``; the one given for a file without
            rows), else None.
    """

    prepared: PreparedData | None
    rows: int
    file_id: list[int]
    skipped: int = 0
    first_skipped: str | None = None
    histories: dict | None = None


def carries_histories(d: DataConfig) -> bool:
    """Whether a ``data.stream`` run carries user histories across partitions (a
    ``data.schema.history`` and ``data.stream.histories: carry``)."""
    h = getattr(d.schema, "history", None) if d.stream is not None and d.format == "schema" else None
    return h is not None and d.stream.histories == "carry"


def history_note(d: DataConfig) -> str | None:
    """The warning a ``data.stream`` run with ``data.schema.history`` and
    ``data.stream.histories: per_partition`` logs at its start (None otherwise): each partition
    is converted on its own, so its users' histories start empty (docs/online.md, "User
    histories"), while a scoring request carries a user's whole history."""
    h = d.schema.history if d.stream is not None and d.schema is not None else None
    if h is None or carries_histories(d):
        return None
    return (
        f"data.stream with data.schema.history ({h.name}): each partition's histories start empty: a row's "
        f"history holds its {h.user}'s earlier rows of the same partition only, never those of earlier "
        "partitions, while a scoring request carries the user's whole history (a training / serving skew for "
        "din, bst, hstu); data.stream.histories: carry keeps them across partitions, docs/online.md 'User histories'"
    )


def convert_partition(d: DataConfig, name: str, cache_dir: str | Path, histories: dict | None = None) -> Partition:
    """Convert the partition ``name`` (below ``d.stream.path``) as one training split into
    ``cache_dir`` (the run's own: ``RUN_DIR/partitions``, emptied of a partition once it is
    trained; keyed by path, size and modification time like any cache entry).

    A file without rows (0 bytes, a header line alone, a Parquet file of 0 rows) gives a
    ``Partition`` of 0 rows and no conversion; its header (Parquet schema) must still name the
    configured columns.

    Under ``data.stream.histories: carry`` (:func:`carries_histories`) its rows' histories
    follow ``histories`` (the state after the partitions before, ``Partition.histories`` of the
    last one; None: none before), which is not changed; the partition is always read (an entry
    of it converted before is converted again: the state after it comes from its rows).

    Raises:
        DataError: the partition is malformed or unreadable (names the file, line and column);
            its ``file_id`` attribute: the file's ``[size, mtime_ns]``.
        FileChanging: its size or modification time changed while it was read, or it vanished
            (nothing is kept).
    """
    path = Path(d.stream.path) / name
    before = _file_id(path)
    prepared = None
    carry = carries_histories(d)
    histories = ({} if histories is None else histories) if carry else None
    try:
        if before[0]:  # a 0-byte file: no conversion (a Parquet reader would call it malformed)
            partition = replace(conversion_spec(d), raw_path=str(path), split=(1.0, 0.0, 0.0), cache_dir=str(cache_dir))
            if carry:  # an entry of its own (per_partition's rows differ), always converted again
                partition.fmt.user_history.carried = histories
                partition.fmt.fingerprint += ";histories:carry"
                _remove_entry(entry_path(partition))
            try:
                prepared = prepare(
                    partition,
                    warn_one_class=False,  # a small partition of one class is normal in a stream
                    coverage=False,  # a partition's tables are the run's: one partition says little about them
                )
            except NoRows:
                _remove_unfinished(Path(cache_dir))
                # A header alone is checked as a file with rows is: another header (a one-line file
                # without one, another schema) is malformed, not an empty partition consumed
                next(iter(partition.fmt.read_chunks(str(path))), None)
    except DataError as err:
        if _file_id(path) != before:  # cut short by a writer still at it, not malformed
            _remove_unfinished(Path(cache_dir))
            raise FileChanging(f"data.stream: partition {path} changed while it was read") from None
        err.file_id = before
        raise
    if _file_id(path) != before:
        if prepared is not None:
            shutil.rmtree(prepared.directory, ignore_errors=True)
            prepared.directory.with_name(f"{prepared.directory.name}.lock").unlink(missing_ok=True)
        raise FileChanging(f"data.stream: partition {path} changed while it was read")
    if prepared is None:
        return Partition(None, 0, before, histories=histories)
    manifest = json.loads((prepared.directory / "manifest.json").read_text())
    examples = manifest.get("skipped_examples") or []
    first = f"line {examples[0]['line']}: {examples[0]['reason']}" if examples else None
    if carry:
        state = partition.fmt.user_history
        if not state.passed():  # cannot be: the entry was removed, so its rows were read
            raise RuntimeError(f"data.stream: partition {path} was converted without reading its rows' histories")
        histories = state.state
    rows = int(prepared.rows["train"])
    return Partition(prepared, rows, before, int(manifest.get("rows_skipped") or 0), first, histories)


def _remove_entry(entry: Path) -> None:
    """Remove a conversion entry (and its lock file), converted before (a resume inside it)."""
    if entry.exists():
        shutil.rmtree(entry, ignore_errors=True)
    entry.with_name(f"{entry.name}.lock").unlink(missing_ok=True)


def _file_id(path: Path) -> list[int]:
    try:
        st = path.stat()
    except OSError:
        raise FileChanging(f"data.stream: partition {path} vanished while it was read") from None
    return [st.st_size, st.st_mtime_ns]


def _remove_unfinished(cache_dir: Path) -> None:
    """Remove what a conversion that kept nothing left in ``cache_dir`` (the run's own, where one
    partition is converted at a time): entries without a manifest, lock files without an entry."""
    if not cache_dir.is_dir():
        return
    for entry in cache_dir.iterdir():
        if entry.is_dir() and not (entry / "manifest.json").is_file():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.endswith(".lock") and not cache_dir.joinpath(entry.name[: -len(".lock")]).is_dir():
            entry.unlink(missing_ok=True)
