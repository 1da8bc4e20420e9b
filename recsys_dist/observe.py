"""Run observability: sampled step-time breakdown, torch.profiler traces.

:class:`TimedTrainPipeline` is TorchRec's ``TrainPipelineSparseDist`` with a stopwatch
around its own stages on one step in ``every_n`` (others run untouched):

- ``time_data_ms``: ``_next_batch`` (waiting for the loader)
- ``time_input_dist_ms``: ``start_/wait_sparse_data_dist`` (the KJT all-to-all, input_dist)
- ``time_forward_ms``: the model forward (lookup, output_dist, dense forward, loss)
- ``time_backward_ms``: backward, including the fused embedding update
- ``time_optimizer_ms``: the dense optimizer step

On CUDA the sampled step synchronises the device around each stage so the times are real.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist


class TimedTrainPipeline(TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` whose stages are timed on sampled steps (see module doc)."""

    def __init__(self, *args, every_n: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.every_n, self.steps_done = every_n, 0
        self._times: dict[str, float] | None = None
        self.last: dict[str, float] = {}
        forward = self._model_fwd
        self._model_fwd = lambda batch: self._timed("time_forward_ms", forward, batch)

    def _timed(self, key: str, fn, *args):
        if self._times is None:
            return fn(*args)
        cuda = self._device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self._device)
        t0 = time.perf_counter()
        out = fn(*args)
        if cuda:
            torch.cuda.synchronize(self._device)
        self._times[key] = self._times.get(key, 0.0) + (time.perf_counter() - t0) * 1000
        return out

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
