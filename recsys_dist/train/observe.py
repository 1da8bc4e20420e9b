"""Run observability: sampled step-time breakdown, the run's wall-time split, torch.profiler traces.

:class:`TimedTrainPipeline` is TorchRec's ``TrainPipelineSparseDist`` with a stopwatch
around its own stages on one step in ``every_n`` (others run untouched):

- ``time_data_ms``: ``_next_batch`` (waiting for the loader)
- ``time_input_dist_ms``: ``start_/wait_sparse_data_dist`` (the KJT all-to-all, input_dist)
- ``time_forward_ms``: the model forward (lookup, output_dist, dense forward, loss)
- ``time_backward_ms``: backward, including the fused embedding update
- ``time_optimizer_ms``: the dense optimizer step

``train.pipeline: base`` (:class:`recsys_dist.train.pipelines.BasePipeline`) has the same
timer without ``time_input_dist_ms``: it distributes a batch inside the model's forward, so
its ``time_forward_ms`` holds input_dist too.

On CUDA the sampled step synchronises the device around each stage so the times are real.

:class:`PhaseClock` splits a run's wall time into exclusive phases (``WALL_PHASES``): the
Trainer runs each part of the job inside ``clock.phase(name)``; a phase entered inside
another is taken out of the outer one (validation inside an epoch counts as ``eval``, not
``train``), and what no phase covers is ``other``, so the parts add up to the wall time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.utils import _override_input_dist_forwards

from recsys_dist.files import write_atomic


class StageTimer:
    """A TorchRec pipeline mixin: stages timed on one step in ``every_n`` (others untouched).

    The subclass calls :meth:`_timed` around its stages; :meth:`progress` opens a sampled step;
    :meth:`pop_times` hands its breakdown (ms per stage) over once."""

    def _init_timer(self, every_n: int | None) -> None:
        self.every_n, self.steps_done = every_n, 0
        self._times: dict[str, float] | None = None
        self.last: dict[str, float] = {}

    def _now(self) -> float:
        """perf_counter seconds, after the device's queued work (on CUDA), so stage times are real."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _add(self, key: str, since: float) -> None:
        self._times[key] = self._times.get(key, 0.0) + (self._now() - since) * 1000

    def _timed(self, key: str, fn, *args):
        if self._times is None:
            return fn(*args)
        t0 = self._now()
        out = fn(*args)
        self._add(key, t0)
        return out

    def progress(self, dataloader_iter):
        self.steps_done += 1
        if self.every_n and self.steps_done % self.every_n == 0:
            self._times = {}
        try:
            return super().progress(dataloader_iter)
        finally:
            if self._times is not None:
                self.last = {k: round(v, 3) for k, v in self._times.items()}
            self._times = None

    def pop_times(self) -> dict[str, float]:
        """The breakdown of the last sampled step, once (then empty until the next one)."""
        last, self.last = self.last, {}
        return last


class TimedTrainPipeline(StageTimer, TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` whose stages are timed on sampled steps (see module doc)."""

    def __init__(self, *args, every_n: int | None = None, **kwargs) -> None:
        self._traced: tuple | None = None  # (model, pipelined modules, their pipelined forwards)
        self.traces = 0
        super().__init__(*args, **kwargs)
        self._init_timer(every_n)
        forward = self._model_fwd
        self._model_fwd = lambda batch: self._timed("time_forward_ms", forward, batch)

    def attach(self, model: torch.nn.Module | None = None, sparse_dist: bool = False) -> None:
        """Rewrite the model's forward again after :meth:`detach` (``progress`` calls this),
        keeping the in-flight batches' input_dist.

        TorchRec's default (``sparse_dist=True``) starts input_dist again for ``batches[0]``,
        whose input_dist already ran before the detach: that replaces its module context with
        a fresh one the forward then reads, and leaves that splits all-to-all unwaited. A
        sharded EmbeddingCollection's output_dist takes its all-to-all sizes from that
        context, so after a mid-epoch validation the next step failed on 2 ranks
        (gloo ``in->size == out->size``); an EmbeddingBagCollection's pooled output_dist
        does not read it."""
        super().attach(model, sparse_dist=sparse_dist)

    def _pipeline_model(self, batch, context, pipelined_forward=PipelinedForward) -> None:
        """Rewrite the model's forward for pipelining. The first call traces it (torch.fx,
        TorchRec's ``_rewrite_model``, ~10-30 ms on DLRM); a later one (after a :meth:`detach`: the
        next partition of a stream, an epoch after a validation) puts the forwards that trace
        made back, with ``context``, instead of tracing the same model again (``traces`` counts
        the traces). A model with pipelined postprocs is traced each time (they are modules the
        rewrite swaps into the model)."""
        kept = self._traced
        if kept is None or kept[0] is not self._model:
            super()._pipeline_model(batch, context, pipelined_forward)
            self.traces += 1
            if not self._pipelined_postprocs:
                self._traced = (
                    self._model,
                    list(self._pipelined_modules),
                    [m.forward for m in self._pipelined_modules],
                )
            return
        _, modules, forwards = kept
        self._original_forwards = [m.forward for m in modules]  # what detach restores
        for module, forward in zip(modules, forwards):
            forward.set_context(context)
            module.forward = forward
        self._pipelined_modules, self._pipelined_postprocs = list(modules), []
        # As TorchRec's own _pipeline_model after its rewrite: input_dist of the first batch, then
        # the input dists' forwards overridden (fused splits), which detach had restored.
        self.start_sparse_data_dist(batch, context)
        self._original_kjt_dist_forwards = _override_input_dist_forwards(self._pipelined_modules)

    def _next_batch(self, dataloader_iter):
        return self._timed("time_data_ms", super()._next_batch, dataloader_iter)

    def start_sparse_data_dist(self, *args, **kwargs):
        return self._timed("time_input_dist_ms", super().start_sparse_data_dist, *args, **kwargs)

    def wait_sparse_data_dist(self, *args, **kwargs):
        return self._timed("time_input_dist_ms", super().wait_sparse_data_dist, *args, **kwargs)

    def _backward(self, losses):
        return self._timed("time_backward_ms", super()._backward, losses)

    def _optimizer_step(self):
        return self._timed("time_optimizer_ms", super()._optimizer_step)


# The wall-time split of summary.json, in the order of a run (docs/run_directory.md).
WALL_PHASES = ("startup", "data", "plan", "tables", "train", "eval", "checkpoint", "publish", "other")
# Set by ``recsys-dist train`` for the ranks it starts: when the command started (Unix time)
# and the seconds of its own phases before the ranks existed (JSON, e.g. {"data": 3.2}).
RUN_START_ENV, EARLIER_PHASES_ENV = "RECSYS_DIST_RUN_START", "RECSYS_DIST_EARLIER_PHASES"


def process_start_time() -> float:
    """This process's start as Unix time (Linux: /proc; elsewhere the first call of this)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        global _FIRST_CALL
        _FIRST_CALL = _FIRST_CALL or time.time()
        return _FIRST_CALL


_FIRST_CALL: float | None = None


class PhaseClock:
    """Exclusive wall-time phases of one run, from ``start`` (Unix time) on.

    ``phase(name)`` is a context manager; phases nest, and the inner one's time is not the
    outer one's. :meth:`split` -> ``{phase: seconds}`` over ``WALL_PHASES`` plus
    ``wall_seconds``; ``other`` is the wall time no phase covered. ``earlier``: seconds of
    phases spent before this process existed (the launcher's data preparation).
    """

    def __init__(self, start: float, earlier: dict[str, float] | None = None) -> None:
        now = time.perf_counter()
        self._start = now - max(0.0, time.time() - start)  # the start on perf_counter's scale
        self.seconds: dict[str, float] = dict.fromkeys(WALL_PHASES, 0.0)
        for k, v in (earlier or {}).items():
            self.seconds[k] += v
        self.seconds["startup"] += max(0.0, now - self._start - sum(self.seconds.values()))
        self._stack: list[str] = []
        self._mark = now

    @classmethod
    def for_run(cls, first_in_process: bool) -> PhaseClock:
        """The clock of a Trainer: from ``$RECSYS_DIST_RUN_START`` (the command's start) when set,
        else from this process's start for its first Trainer, else from now."""
        start = os.environ.get(RUN_START_ENV)
        earlier = json.loads(os.environ.get(EARLIER_PHASES_ENV) or "{}")
        if start:
            return cls(float(start), earlier)
        return cls(process_start_time() if first_in_process else time.time())

    def _switch(self) -> None:
        now = time.perf_counter()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._mark
        self._mark = now

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; one of {WALL_PHASES}")
        self._switch()
        self._stack.append(name)
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()

    def split(self) -> dict:
        """``{"wall_seconds": s, "wall_split": {phase: s, ..., "other": s}}``, rounded to ms;
        the parts add up to ``wall_seconds`` (to rounding)."""
        self._switch()
        wall = time.perf_counter() - self._start
        parts = {k: v for k, v in self.seconds.items() if k != "other"}
        parts["other"] = max(0.0, wall - sum(parts.values()))
        return {"wall_seconds": round(wall, 3), "wall_split": {k: round(v, 3) for k, v in parts.items()}}


class TraceWriter:
    """``--profile``: a torch.profiler Chrome trace of steps [start, start + count) per rank."""

    def __init__(self, out_dir: Path | None, rank: int, start: int = 5, count: int = 3) -> None:
        self.out_dir, self.rank, self.start, self.count = out_dir, rank, start, count
        self._prof = None

    def before(self, step: int) -> None:
        if self.out_dir is not None and step == self.start:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities, record_shapes=True)
            self._prof.__enter__()

    def after(self, step: int) -> None:
        if self._prof is not None and step >= self.start + self.count - 1:
            self.close()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            prof = self._prof
            write_atomic(self.out_dir / f"trace_rank{self.rank}.json", lambda p: prof.export_chrome_trace(str(p)))
            self._prof = None
