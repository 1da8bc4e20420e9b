"""CommCounter's delayed work (recsys_dist.distributed.comm_counter._DelayedWork is reached through the
public wrapper only in a process group; here a stand-in backend work drives it in-process)."""

import datetime

import pytest
import torch

from recsys_dist.distributed import comm_counter


class _Work:
    """A finished backend work; ``futures`` False is a gloo work without getFuture."""

    def __init__(self, futures: bool) -> None:
        self.futures = futures
        self.out = [torch.ones(2)]

    def get_future(self):
        if not self.futures:
            raise RuntimeError("Work::getFuture not implemented")
        fut = torch.futures.Future()
        fut.set_result(self.out)
        return fut

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self):
        return self.out


def _delayed(futures: bool, delay: float):
    return comm_counter._DelayedWork(_Work(futures), delay)


@pytest.mark.parametrize("futures", [True, False])
def test_a_waited_work_is_completed_and_has_its_result(futures):
    work = _delayed(futures, 0.0)
    assert work.wait()
    # a work without a future was never marked done: is_completed() stayed False (a poller hung)
    assert work.is_completed()
    assert work.result()[0].tolist() == [1.0, 1.0]


def test_wait_timeout_covers_the_injected_delay():
    work = _delayed(True, 30.0)
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait(timeout=datetime.timedelta(milliseconds=10))
    # timedelta(0) is torch's "no timeout"
    assert _delayed(True, 0.0).wait(timeout=datetime.timedelta(0))


@pytest.mark.parametrize("delay_ms", [-2.0, float("nan"), float("inf")])
def test_bad_delay_is_refused(delay_ms):
    with pytest.raises(ValueError, match="delay_ms must be a finite number >= 0"):
        comm_counter.CommCounter(delay_ms=delay_ms)


def test_a_failed_entry_leaves_nothing_patched_or_entered():
    import torch.distributed as dist

    class Broken(torch.nn.Module):
        def modules(self):  # as a DDP whose comm hook cannot be registered
            raise RuntimeError("register_comm_hook can only be called once")

    original = dist.all_reduce
    with pytest.raises(RuntimeError, match="only be called once"):
        with comm_counter.CommCounter(Broken()):
            pass
    assert dist.all_reduce is original and comm_counter.CommCounter._active is None
    with comm_counter.CommCounter():  # a later counter is not refused as "already counting"
        pass


def test_a_model_with_managed_tables_can_be_counted():
    # ManagedRemap keeps a ``_lookups`` tensor buffer; entering failed on its truth value
    # ("Boolean value of Tensor with more than one value is ambiguous")
    from recsys_dist.models.managed import ManagedRemap, ReplicatedMCH

    model = torch.nn.Sequential(ManagedRemap({"f": ReplicatedMCH(10, "lfu", 1, history_capacity=16)}))
    with comm_counter.CommCounter(model) as counter:
        pass
    assert counter.counts["other"] == {"sent": 0, "received": 0}


def test_byte_rules_of_fsdp_collectives_and_a_one_rank_all_reduce():
    t = torch.zeros(6)  # 24 bytes
    # FSDP2's: a rank's chunk of 24 bytes over 3 ranks, each way W - 1 chunks
    assert comm_counter._bytes("all_gather_single", {"output_tensor": torch.zeros(18), "input_tensor": t}, 3, 0) == (
        48,
        48,
    )
    assert comm_counter._bytes("reduce_scatter_single", {"output": t, "input": torch.zeros(18)}, 3, 1) == (48, 48)
    # the ledger's rule: a world of one rank moves nothing (DDP over data_parallel tables at 1 rank
    # all-reduced over a group of one, counted as its payload)
    assert comm_counter._bytes("all_reduce", {"tensor": t}, 1, 0) == (0, 0)
    assert comm_counter._bytes("all_reduce", {"tensor": t}, 2, 0) == (24, 24)
