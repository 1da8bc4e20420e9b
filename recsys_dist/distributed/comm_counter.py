"""Counting (and optionally delaying) the bytes of a real run at torch.distributed's collectives.

:class:`CommCounter` replaces ``torch.distributed``'s collectives (the names TorchRec's
``comm_ops`` and ``dist_data`` call at run time) with counting wrappers while it is
entered, and hooks every ``DistributedDataParallel`` inside a model (the dense tower and the
data_parallel tables) to count its gradient all-reduce, which DDP issues from C++; FSDP2's
all-gathers and reduce-scatters (``fsdp_all_gather``, ``fsdp_reduce_scatter``) are counted at
``all_gather_single`` / ``reduce_scatter_single``. Each byte
is booked to a phase of :mod:`recsys_dist.distributed.ledger` by the TorchRec frame that issued the call:
``dist_data`` (the KJT all-to-all) -> ``input_dist``; ``comm_ops`` -> ``output_dist_forward``,
or ``output_dist_backward`` from an autograd ``backward``; DDP -> ``allreduce``; the
managed-collision tables' id all_gathers (``ManagedRemap.issuing_collective``) ->
``managed_all_gather``; anything else (metrics, checkpoints) -> ``other``. The counting rules are the ledger's.

Off the training path: the trainer never uses it. Tests (``tests/ranks/distributed/test_ledger.py``)
compare its counts with :func:`recsys_dist.distributed.ledger.predict`; the overlap benchmark uses
``delay_ms`` to add a fixed latency to every collective (a stand-in for a network,
labelled as such in its results): every collective's result arrives ``delay_ms`` after the
backend delivered it (the last rank's data had arrived), as over a link with that latency. An
asynchronous collective's ``wait()`` (and its ``get_future()``, which DDP's all-reduce hook
waits on) completes ``delay_ms`` after the backend completed it, so compute between issue
and wait can hide it; a synchronous one sleeps ``delay_ms`` after it returns. Counting from
completion rather than from issue matters: ranks arrive at a collective at different times,
and a delay counted from a rank's own issue is absorbed by its wait for a later rank.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from recsys_dist.distributed.ledger import PHASES
from recsys_dist.models.managed import ManagedRemap

_PATCHED = (
    "all_to_all_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    # FSDP2's (torch.distributed.fsdp._fully_shard._fsdp_collectives)
    "all_gather_single",
    "reduce_scatter_single",
)


def _phase(op: str) -> tuple[str, str]:
    """(phase, label) of the collective ``op`` being issued, from the nearest TorchRec (or DDP,
    FSDP) frame, or the managed-collision tables' own hook."""
    if ManagedRemap.issuing_collective():  # the managed-collision tables' id all_gather (its hook)
        return "managed_all_gather", "managed"
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if "ddp_comm_hooks" in path:
            return "allreduce", "ddp"
        if "_fully_shard" in path:  # FSDP2 (distributed.dense.strategy: fsdp)
            if "all_gather" in op:
                return "fsdp_all_gather", "fsdp"
            return ("fsdp_reduce_scatter", "fsdp") if "reduce_scatter" in op else ("other", "fsdp")
        if "torchrec" in path and path.endswith("comm_ops.py"):
            return ("output_dist_backward" if f.f_code.co_name == "backward" else "output_dist_forward"), ""
        if "torchrec" in path and path.endswith("dist_data.py"):
            label = f.f_locals.get("label")
            return "input_dist", str(label) if label is not None else "splits"
        f = f.f_back
    return "other", ""


class _DelayedWork(dist.Work):
    """A ``dist.Work`` that completes ``delay`` seconds after ``work`` completed.

    The completion time is taken in the backend's thread (a callback on the work's future),
    so a ``wait()`` that comes late, after compute, waits only for what is left of the delay
    (a work without a future counts it from the end of its ``wait()``).
    A ``dist.Work`` subclass, not a proxy: TorchRec only waits on what ``isinstance(...,
    dist.Work)`` (a proxy made it read the splits before they arrived)."""

    def __init__(self, work, delay: float, on_wait=None) -> None:
        super().__init__()
        self._work, self._delay, self._on_wait = work, delay, on_wait
        self._done_at: float | None = None
        try:
            work.get_future().add_done_callback(self._mark)
        except RuntimeError:  # "Work::getFuture not implemented" (some gloo works): counted from wait()
            pass

    def _mark(self, _fut) -> None:
        if self._done_at is None:  # wait() may have stamped it already (the callback ran late)
            self._done_at = time.perf_counter()

    def _ready(self) -> float:
        # the callback may not have run yet when wait() returns: then it completed just now
        return (self._done_at or time.perf_counter()) + self._delay

    def wait(self, timeout=None) -> bool:
        """As ``dist.Work.wait``; ``timeout`` (a ``timedelta``) covers the delay too: a result
        due after it raises ``RuntimeError``, as a collective that timed out does."""
        t0 = time.perf_counter()
        out = self._work.wait() if timeout is None else self._work.wait(timeout)
        if self._done_at is None:  # no future, or its callback has not run yet: completed now
            self._done_at = time.perf_counter()
        left = self._ready() - time.perf_counter()
        # timedelta(0) is torch's kNoTimeout
        if timeout is not None and timeout.total_seconds() > 0 and t0 + timeout.total_seconds() < self._ready():
            time.sleep(max(0.0, t0 + timeout.total_seconds() - time.perf_counter()))
            raise RuntimeError(
                f"CommCounter: collective timed out after {timeout} (the injected delay of "
                f"{self._delay * 1000:g} ms was still running)"
            )
        if left > 0:
            time.sleep(left)
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - t0)
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed() and self._done_at is not None and time.perf_counter() >= self._ready()

    def result(self):
        """The backend work's output tensors (after :meth:`wait`)."""
        return self._work.result()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def get_future(self):
        """A future set ``delay`` after the backend's (DDP's comm hook waits on this one); the
        backend's own without a delay (no timer thread per call when only counting)."""
        if not self._delay:
            return self._work.get_future()
        delayed = torch.futures.Future()

        def later(fut) -> None:
            def fire() -> None:
                try:
                    delayed.set_result(fut.value())
                except Exception as err:  # noqa: BLE001 - the backend's error, passed on
                    delayed.set_exception(err)

            threading.Timer(self._delay, fire).start()

        self._work.get_future().add_done_callback(later)
        return delayed

    def synchronize(self) -> None:
        self.wait()


class CommCounter:
    """Bytes per phase at the collectives while entered (see the module doc).

    Args:
        model: hook the DDP modules inside it (DMP: dense tower and data_parallel tables)
            so their all-reduce is counted; None counts the Python-level collectives only.
            Hooks stay on the model after exit and only count while a counter is entered.
        delay_ms: added latency per collective (0 = none).

    Raises:
        ValueError: ``delay_ms`` negative, NaN or infinite. ``RuntimeError`` on entry while
            another counter is entered (counters do not nest).

    Attributes:
        counts: phase -> {"sent", "received"} bytes since entry or :meth:`reset`.
        calls: (phase, op, label, sent, received) per collective, in order.
        exposed: phase -> seconds the calling thread was blocked by training collectives:
            inside an asynchronous one's ``wait()`` or a synchronous call (the communication
            compute did not hide). With a ``model``, only while it is in training mode
            (evaluation's collectives are left out). DDP's all-reduce is waited on in C++ and
            is not in it.
    """

    _active: CommCounter | None = None

    def __init__(self, model=None, delay_ms: float = 0.0) -> None:
        # a negative or NaN delay made time.sleep raise at the first synchronous collective,
        # deep in a rank; an infinite one left DDP's all-reduce future unset (a hang)
        if not (0 <= delay_ms < float("inf")):
            raise ValueError(f"delay_ms must be a finite number >= 0, got {delay_ms}")
        self.delay_s = delay_ms / 1000
        self._model = model
        self._saved: dict = {}
        self.reset()

    def reset(self) -> None:
        self.counts = {p: {"sent": 0, "received": 0} for p in (*PHASES, "other")}
        self.calls: list[tuple] = []
        self.exposed = {p: 0.0 for p in (*PHASES, "other")}

    def book(self, phase: str, op: str, label: str, sent: int, received: int) -> None:
        self.counts[phase]["sent"] += sent
        self.counts[phase]["received"] += received
        self.calls.append((phase, op, label, sent, received))

    def __enter__(self) -> CommCounter:
        if CommCounter._active is not None:
            raise RuntimeError("a CommCounter is already counting")
        CommCounter._active = self
        for name in _PATCHED:
            original = getattr(dist, name)
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        if self._model is not None:
            try:
                _hook_ddp(self._model)
            except BaseException:
                # e.g. a DDP that already has a comm hook: leave nothing patched or entered
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}
        CommCounter._active = None

    def _exposer(self, phase: str):
        def add(seconds: float) -> None:
            self.exposed[phase] += seconds

        return add

    def _wrap(self, name: str, fn):
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            a = sig.bind(*args, **kwargs).arguments
            group = a.get("group")
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            sent, received = _bytes(name, a, world, rank)
            phase, label = _phase(name)
            self.book(phase, name, label, sent, received)
            training = self._model is None or self._model.training  # evaluation puts the model in eval()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if a.get("async_op") and out is not None:
                return _DelayedWork(out, self.delay_s, self._exposer(phase) if training else None)
            if self.delay_s:
                time.sleep(self.delay_s)
            if training:
                self.exposed[phase] += time.perf_counter() - t0
            return out

        return counted


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _bytes(op: str, a: dict, world: int, rank: int) -> tuple[int, int]:
    if op == "all_to_all_single":
        out, inp = a["output"], a["input"]
        in_splits, out_splits = a.get("input_split_sizes"), a.get("output_split_sizes")
        row_in = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else inp.element_size()
        row_out = _nbytes(out) // max(out.shape[0], 1) if out.dim() else out.element_size()
        own_in = in_splits[rank] if in_splits else inp.shape[0] // world
        own_out = out_splits[rank] if out_splits else out.shape[0] // world
        return _nbytes(inp) - own_in * row_in, _nbytes(out) - own_out * row_out
    if op == "reduce_scatter_tensor":
        return _nbytes(a["input"]) - _nbytes(a["output"]), _nbytes(a["output"]) * (world - 1)
    if op == "reduce_scatter":
        chunks = a["input_list"]
        return sum(_nbytes(c) for i, c in enumerate(chunks) if i != rank), _nbytes(a["output"]) * (world - 1)
    if op == "reduce_scatter_single":
        return _nbytes(a["input"]) - _nbytes(a["output"]), _nbytes(a["output"]) * (world - 1)
    if op == "all_gather_single":
        return _nbytes(a["input_tensor"]) * (world - 1), _nbytes(a["output_tensor"]) - _nbytes(a["input_tensor"])
    if op == "all_gather_into_tensor":
        return _nbytes(a["input_tensor"]) * (world - 1), _nbytes(a["output_tensor"]) - _nbytes(a["input_tensor"])
    if op == "all_gather":
        chunks = a["tensor_list"]
        return _nbytes(a["tensor"]) * (world - 1), sum(_nbytes(c) for i, c in enumerate(chunks) if i != rank)
    if op == "all_reduce":  # a group of one rank moves nothing (DDP over data_parallel tables at world 1)
        return (_nbytes(a["tensor"]),) * 2 if world > 1 else (0, 0)
    raise ValueError(op)


def _ddp_count_hook(process_group, bucket):
    # DDP's own all-reduce, issued through torch.distributed.all_reduce, so that the
    # patched function counts it (as ``allreduce``: the caller is a ddp_comm_hooks frame).
    return allreduce_hook(process_group, bucket)


def _hook_ddp(model) -> None:
    # TorchRec keeps each data_parallel table group's DDP in a plain list (``_lookups``), out
    # of ``modules()``.
    found = list(model.modules())
    # only TorchRec's lists: recsys_dist.models.managed keeps a ``_lookups`` tensor (counts)
    found += [lk for m in found if isinstance(getattr(m, "_lookups", None), (list, nn.ModuleList)) for lk in m._lookups]
    for m in found:
        if isinstance(m, DistributedDataParallel) and not getattr(m, "_recsys_counted", False):
            m.register_comm_hook(m.process_group, _ddp_count_hook)
            m._recsys_counted = True
