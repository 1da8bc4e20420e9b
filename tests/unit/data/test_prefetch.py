"""The one read-ahead thread of the data path: order, errors, eager start, early stop."""

import threading
import time

import pytest

from recsys_dist.data.prefetch import prefetched


def test_order_errors_and_early_stop():
    assert list(prefetched(iter(range(100)), 3)) == list(range(100))

    def bad():
        yield 1
        raise ValueError("row 7 is bad")

    it = prefetched(bad(), 2)
    assert next(it) == 1
    with pytest.raises(ValueError, match="row 7 is bad"):
        next(it)

    it = prefetched(iter(range(10**6)), 2, name="t-early-stop")
    assert next(it) == 0
    it.close()  # the producer is stopped and joined, not left blocked on a full queue
    assert not any(t.name == "t-early-stop" for t in threading.enumerate())


def test_producer_starts_before_the_first_next():
    started = threading.Event()

    def gen():
        started.set()
        yield 1

    it = prefetched(gen(), 1)
    assert started.wait(5), "read-ahead did not start on opening"
    assert list(it) == [1]


def test_an_unstarted_iterator_that_is_dropped_releases_its_thread():
    it = prefetched(iter(range(10**6)), 1, name="t-dropped")
    del it
    deadline = time.monotonic() + 5
    while any(t.name == "t-dropped" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "t-dropped" for t in threading.enumerate())


def test_auto_prefetch_only_with_a_core_to_spare():
    from recsys_dist.data.prefetch import AUTO_PREFETCH, auto_prefetch

    assert auto_prefetch("cpu", 2, 1, cpus=2) == 0  # 2 ranks x 1 thread take both cores
    assert auto_prefetch("cpu", 1, 1, cpus=2) == AUTO_PREFETCH
    assert auto_prefetch("cpu", 2, 4, cpus=8) == 0
    assert auto_prefetch("cpu", 2, 3, cpus=8) == AUTO_PREFETCH
    assert auto_prefetch("cuda", 8, 16, cpus=8) == AUTO_PREFETCH  # the training thread waits on the GPU
