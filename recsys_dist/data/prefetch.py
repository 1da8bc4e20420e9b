"""One background-thread read-ahead for every producer of the data path (conversion blocks,
loader windows, loader batches)."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


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
