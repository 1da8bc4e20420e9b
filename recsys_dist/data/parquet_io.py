"""Opening Parquet files for the loader's reads, decoded into the system allocator's pool.

pyarrow 26 decodes into its default pool, mimalloc on Linux. Measured on the 2-core
development machine (``benchmarks/results/step_overhead_pool_cpu2core_20261202.md``): a
window of 196,000 Criteo rows decoded in 0.06-0.16 s the first time, but in 0.3-1.3 s (0.7-1.0 s
of CPU in pyarrow's threads, no disk reads, no more page faults) once other work had run in
the process between two epochs, e.g. another model's steps; with the system pool (glibc
malloc) it stayed at 0.06-0.19 s. That was a serial stall at the first batch of each such epoch.

``ARROW_DEFAULT_MEMORY_POOL``, when set, is respected: the files then decode into the pool
it names.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs


def read_pool() -> pa.MemoryPool:
    """The pool the loader decodes into: the system pool, unless ``ARROW_DEFAULT_MEMORY_POOL`` names one."""
    return pa.default_memory_pool() if os.environ.get("ARROW_DEFAULT_MEMORY_POOL") else pa.system_memory_pool()


class PooledParquetFile:
    """A Parquet file whose row-group reads allocate from one pool (``pq.ParquetFile`` takes
    none: it builds its reader on the default pool of the moment).

    Built on ``pq.ParquetReader(memory_pool=...)``, the reader ``pq.ParquetFile`` wraps, so no
    process-wide setting changes: swapping the default pool while a file opened showed the
    system pool to every other thread meanwhile, and undid a ``pa.set_memory_pool`` that
    another thread made then.

    Args:
        path: a local Parquet file.
        pool: the pool its reads decode into (held by pointer: it must outlive the reads'
            buffers, as pyarrow's own pools do).

    Raises:
        OSError, pyarrow.ArrowInvalid: as ``pq.ParquetFile`` (missing or not Parquet).
    """

    def __init__(self, path: str, pool: pa.MemoryPool) -> None:
        self.reader = pq.ParquetReader(memory_pool=pool)
        # Opened as pq.ParquetFile opens a local path (pyarrow 26), so that only the decoding moves.
        self.reader.open(fs.LocalFileSystem().open_input_file(str(path)), pre_buffer=True)
        self._leaves: dict[str, list[int]] = {}  # top-level column -> its leaf columns (a list: one)
        for i, column_path in enumerate(self.reader.column_paths):
            self._leaves.setdefault(column_path[0], []).append(i)

    @property
    def metadata(self) -> pq.FileMetaData:
        return self.reader.metadata

    def read_row_groups(self, row_groups: Sequence[int], columns: Sequence[str]) -> pa.Table:
        """As ``pq.ParquetFile.read_row_groups(row_groups, columns=columns)`` (top-level
        columns; pyarrow's threads decode them).

        Raises:
            KeyError: a column the file does not have.
        """
        leaves = [i for name in columns for i in self._leaves[name]]
        return self.reader.read_row_groups(list(row_groups), column_indices=leaves, use_threads=True)


def open_parquet(path: str) -> PooledParquetFile:
    """``path`` opened for reads that allocate from :func:`read_pool` (see :class:`PooledParquetFile`).

    Raises:
        OSError, pyarrow.ArrowInvalid: as ``pq.ParquetFile`` (missing or not Parquet).
    """
    return PooledParquetFile(path, read_pool())
