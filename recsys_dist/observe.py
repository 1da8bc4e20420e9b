"""Run observability: sampled step-time breakdown, torch.profiler traces, progress bar.

The step breakdown profiles one step every ``train.timing_every_n_steps`` with
``torch.profiler`` (CPU activities) and sums the time spent inside TorchRec's own
``record_function`` ranges of ``TrainPipelineSparseDist.progress``:

- ``time_data_ms``: ``## next_batch ##`` (waiting for the loader)
- ``time_input_dist_ms``: ``start_/wait_sparse_data_dist`` (KJT all-to-all, input_dist)
- ``time_forward_ms``: ``## forward ##`` (lookup, output_dist, dense forward, loss)
- ``time_backward_ms``: ``## backward ##`` (including the fused embedding update)
- ``time_optimizer_ms``: ``## optimizer ##`` (dense optimizer step)

Other steps run unprofiled, so the overhead is one profiled step in N.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

_PHASES = {
    "time_data_ms": ("## next_batch",),
    "time_input_dist_ms": ("## start_sparse_data_dist", "## wait_sparse_data_dist"),
    "time_forward_ms": ("## forward",),
    "time_backward_ms": ("## backward",),
    "time_optimizer_ms": ("## optimizer",),
}


class StepTimer:
    """Profile one step in ``every_n``; ``last`` holds that step's breakdown in ms."""

    def __init__(self, every_n: int | None) -> None:
        self.every_n = every_n
        self.last: dict[str, float] = {}
        self._prof = None

    @contextlib.contextmanager
    def step(self, step: int):
        if not self.every_n or step % self.every_n:
            yield
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        totals = dict.fromkeys(_PHASES, 0.0)
        for event in prof.key_averages():
            for key, prefixes in _PHASES.items():
                if event.key.startswith(prefixes):
                    totals[key] += event.cpu_time_total / 1000.0
        self.last = {k: round(v, 3) for k, v in totals.items()}

    def pop(self) -> dict[str, float]:
        """The breakdown of the last profiled step, once (then empty until the next one)."""
        last, self.last = self.last, {}
        return last


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
            self._prof.export_chrome_trace(str(self.out_dir / f"trace_rank{self.rank}.json"))
            self._prof = None
