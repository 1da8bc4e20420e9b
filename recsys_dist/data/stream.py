"""Partitions that land in a directory: which are there, and each one converted on its own.

``data.stream`` (docs/online.md) trains on the files that appear under ``stream.path``. A
file is *landed* once it matches ``stream.pattern`` and its name does not start with ``.``
or ``_`` (the lake convention: a writer fills ``.part.tmp`` or ``_temporary/...`` and renames
the finished file into place, atomically; ``_SUCCESS`` markers are not data). Partitions are
named by their path below ``stream.path`` (``day=3/hour=07/part-0.txt``) and taken in the
sort order of those names.

Each partition is converted like a batch run's raw file (same format, same mapping), as one
split: every row is training data, into the run's own directory (a stream would otherwise
fill the shared conversion cache without end); the trainer removes a partition's Parquet once
it has trained it and saved the checkpoint that records it. Hash and managed mapping only: both map a
value the same way in every partition (a vocabulary would need all the data up front).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from recsys_dist.data.config import DataConfig, StreamConfig
from recsys_dist.data.convert import PreparedData, prepare
from recsys_dist.data.resolve import conversion_spec
from recsys_dist.errors import DataError


def landed(stream: StreamConfig) -> list[str]:
    """Names (posix paths below ``stream.path``) of the landed partition files, sorted.

    Raises:
        DataError: ``stream.path`` is not a readable directory.
    """
    root = Path(stream.path)
    if not root.is_dir():
        raise DataError(f"data.stream.path: {root} is not a directory (it was, when the run started)")
    names = []
    for f in root.glob(stream.pattern):
        rel = f.relative_to(root)
        if any(part.startswith((".", "_")) for part in rel.parts) or not f.is_file():
            continue
        names.append(rel.as_posix())
    return sorted(names)


def convert_partition(d: DataConfig, name: str, cache_dir: str | Path) -> PreparedData:
    """Convert the partition ``name`` (below ``d.stream.path``) as one training split into
    ``cache_dir`` (the run's own: ``RUN_DIR/partitions``, emptied of a partition once it is
    trained; keyed by path, size and modification time like any cache entry).

    Returns:
        ``PreparedData`` whose ``train`` split holds every row of the partition (``validation``
        and ``test`` are empty).

    Raises:
        DataError: the partition is malformed (names the file, line and column), unreadable,
            or vanished.
    """
    path = Path(d.stream.path) / name
    if not path.is_file():
        raise DataError(f"data.stream: partition {path} vanished before it was read")
    partition = replace(conversion_spec(d), raw_path=str(path), split=(1.0, 0.0, 0.0), cache_dir=str(cache_dir))
    return prepare(
        partition,
        warn_one_class=False,  # a small partition of one class is normal in a stream
        coverage=False,  # a partition's tables are the run's: one partition says little about them
    )
