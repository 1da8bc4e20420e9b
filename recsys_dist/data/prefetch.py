"""One background-thread read-ahead for every producer of the data path (conversion blocks,
loader windows, loader batches)."""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

AUTO_PREFETCH = 2  # data.prefetch when the node has a core to spare for the loader's threads


def auto_prefetch(device_type: str, local_world_size: int, threads_per_rank: int, cpus: int | None = None) -> int:
    """``data.prefetch: null``: :data:`AUTO_PREFETCH` batches made ahead in background threads
    on CUDA (the training thread mostly waits for the device) or when the node has more cores
    than its ranks' intra-op threads (``cpus``, default ``os.cpu_count()``); else 0, everything in
    the training thread. Where the ranks' threads already take every core, the loader's threads
    cost more CPU than they hide: 2 ranks x 1 thread on 2 cores, 1.0-1.8 ms CPU a step more
    with prefetch 2 than with 0 at batch 128 in two paired 8-round A/Bs
    (benchmarks/results/step_overhead_ab_cpu2core_20261202.md; a size not separated from the
    A/Bs' block-of-epochs effect, see its caveat).
    """
    cpus = cpus or os.cpu_count() or 1
    spare = cpus > local_world_size * max(1, threads_per_rank)
    return AUTO_PREFETCH if device_type == "cuda" or spare else 0


def prefetched(items: Iterator[T], depth: int, name: str = "recsys_dist-prefetch") -> Iterator[T]:
    """``items``, produced up to ``depth`` ahead in a thread that starts now (not at the first
    ``next``), so opening an iterator early overlaps its first read with other work.

    The producer's exceptions are re-raised in the consumer. When the consumer stops early
    (``close()``, an exception, or being garbage-collected), the producer stops at its next
    item (and is joined when the consumer had started). Memory: ``depth`` items beyond the one in use.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():  # a timeout, so a stopped consumer never leaves us blocked
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(("ok", item)):
                    return
            put(("ok", done))
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer, with its message
            put(("err", err))

    thread = threading.Thread(target=produce, daemon=True, name=name)
    thread.start()

    def consume() -> Iterator[T]:
        try:
            while True:
                status, item = q.get()
                if status == "err":
                    raise item
                if item is done:
                    return
                yield item
        finally:
            stop.set()
            thread.join()

    gen = consume()
    weakref.finalize(gen, stop.set)  # dropped without being started: let the producer go
    return gen
