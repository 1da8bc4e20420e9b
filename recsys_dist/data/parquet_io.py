"""Opening Parquet files for the loader's reads, decoded into the system allocator's pool.

pyarrow 26 decodes into its default pool, mimalloc on Linux. Measured on the 2-core
development machine (``benchmarks/results/step_overhead_pool_cpu2core_20261202.md``): a
window of 196,000 Criteo rows decoded in 0.06-0.16 s the first time, but in 0.3-1.3 s (0.7-1.0 s
of CPU in pyarrow's threads, no disk reads, no more page faults) once other work had run in
the process between two epochs, e.g. another model's steps; with the system pool (glibc
malloc) it stayed at 0.06-0.16 s. That was a serial stall at every epoch's first batch.

``ARROW_DEFAULT_MEMORY_POOL``, when set, is respected: the files then decode into the pool
it names.
"""

from __future__ import annotations

import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq

_SWAP = threading.Lock()  # the default pool is process-wide: one swap at a time


def read_pool() -> pa.MemoryPool:
    """The pool the loader decodes into: the system pool, unless ``ARROW_DEFAULT_MEMORY_POOL`` names one."""
    return pa.default_memory_pool() if os.environ.get("ARROW_DEFAULT_MEMORY_POOL") else pa.system_memory_pool()


def open_parquet(path: str) -> pq.ParquetFile:
    """``pq.ParquetFile(path)`` whose reads allocate from :func:`read_pool`.

    ``ParquetFile`` takes no pool; its reader keeps the default pool of the moment it is
    built, so the default is swapped for that moment only (allocations of other threads in
    that moment go to the system pool too, which frees them alike).

    Raises:
        OSError, pyarrow.ArrowInvalid: as ``pq.ParquetFile`` (missing or not Parquet).
    """
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return pq.ParquetFile(path)
    with _SWAP:
        before = pa.default_memory_pool()
        pa.set_memory_pool(read_pool())
        try:
            return pq.ParquetFile(path)
        finally:
            pa.set_memory_pool(before)
