"""recsys_dist.data.workers.OrderedPool: results in input order, errors in order, a dead worker named."""

import operator
import os

import pytest

from recsys_dist.data.workers import OrderedPool, WorkerDied


def test_results_come_in_input_order_from_several_workers():
    with OrderedPool(2, operator.mul) as pool:
        got = list(pool.map([(i, 3) for i in range(7)]))
    assert got == [((i, 3), 3 * i) for i in range(7)]


def test_an_error_is_raised_in_order_and_a_dead_worker_is_named():
    with OrderedPool(2, int) as pool:
        it = pool.map([("1",), ("2",), ("x",), ("4",)])
        assert [r for _, r in (next(it), next(it))] == [1, 2]
        with pytest.raises(ValueError, match="invalid literal for int"):
            next(it)
    with OrderedPool(1, os._exit) as pool, pytest.raises(WorkerDied, match=r"answering for 3 \(exit code 3"):
        list(pool.map([(3,)]))


def test_sigterm_inside_the_pool_exits_and_is_restored_after():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info, OrderedPool(1, operator.neg) as pool:
        assert [r for _, r in pool.map([(1,)])] == [-1]
        os.kill(os.getpid(), signal.SIGTERM)
    assert exit_info.value.code == 143 and not any(p.poll() is None for p in pool.procs)
    assert signal.getsignal(signal.SIGTERM) is before
