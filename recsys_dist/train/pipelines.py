"""``train.pipeline``: which TorchRec training pipeline runs the steps.

- ``sparse_dist`` (default): ``TrainPipelineSparseDist``; the input_dist of batch i+1 is
  issued before the forward/backward of batch i, so it can overlap them. Stage times are
  sampled (:class:`recsys_dist.train.observe.TimedTrainPipeline`).
- ``base``: ``TrainPipelineBase``; no pipelining: each step loads, distributes, computes.
  Stage times as sparse_dist's, its forward holding input_dist (no ``time_input_dist_ms``).
- ``semi_sync``: ``TrainPipelineSemiSync``; the embedding lookup (input_dist, lookup,
  output_dist) of batch i+1 runs right after the forward of batch i, before batch i's
  backward updates the tables. So batch i+1's pooled embeddings are read from the tables as
  they were after step i-1 (one update stale), while its dense forward sees the dense weights
  after step i; its embedding gradients (computed at the stale values) are applied as usual.
  Semi-synchronous from the first batch (``start_batch=0``). A checkpoint restarts the
  pipeline (the batches it had looked up are read again), so a resumed run equals an
  uninterrupted one.
- ``fused_sparse_dist``: ``TrainPipelineFusedSparseDist``: batch i+1's embedding lookup and
  output_dist run on a side stream during batch i's optimizer step.

semi_sync and fused_sparse_dist need CUDA; on CPU the config check refuses them, saying why
(their :class:`PipelineFactory`'s ``why_cuda``).

:data:`PIPELINES` is the one registry of names: ``train.pipeline``'s Literal
(``recsys_dist.train.config.PipelineName``, a section config that cannot import torch) must name
the same set (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineBase,
    TrainPipelineFusedSparseDist,
    TrainPipelineSemiSync,
)

from recsys_dist.train.config import PipelineName
from recsys_dist.train.observe import StageTimer, TimedTrainPipeline


class TrainPipeline(Protocol):
    """What the Trainer uses of a training pipeline.

    Attributes:
        steps_done: steps run so far (global: the Trainer sets it on a new pipeline, so that
            timing samples the same steps after a restart).
    """

    steps_done: int

    def progress(self, dataloader_iter: Iterator) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; its output (loss, ...).

        Raises:
            StopIteration: the iterator and the pipeline's queue are both empty.
        """

    def detach(self) -> torch.nn.Module:
        """Give the model its plain forward back (before scoring); the next ``progress``
        re-attaches. Returns the model."""

    def pop_times(self) -> dict[str, float]:
        """Stage times (ms, ``time_<stage>_ms``) of the sampled steps since the last call; {}
        for a pipeline without a breakdown."""

    def reset(self) -> None:
        """Forget the iterator it ran dry, to take a new one (the Trainer's next epoch or
        partition, when the factory is ``reusable``)."""


# Why a pipeline cannot run on CPU, as measured with torchrec 1.8.0 on torch 2.13 CPU.
_RECORD = (
    "records the batch / the looked-up features on torch.cpu.current_stream(), which "
    "Tensor.record_stream refuses on CPU (RuntimeError: unknown parameter type) at the first step"
)


@dataclass(frozen=True)
class PipelineFactory:
    """A ``train.pipeline`` choice.

    Attributes:
        make: ``make(model, optimizer, device, every_n) -> TrainPipeline`` over a DMP and its
            optimizer (``every_n``: ``train.timing_every_n_steps``).
        cuda_only: refused on any other device (by the config check, with ``why_cuda``).
        why_cuda: why it cannot run on CPU (the config error's reason and fix).
        restart_at_checkpoint: its queued batches hold state computed before the step's update
            (semi_sync's early lookups): the Trainer restarts it at a checkpoint, so that a
            resumed run computes the same.
        reusable: once it ran an iterator dry, ``reset()`` readies it for the next one with
            the same results as a new pipeline: the Trainer keeps it across epochs and stream
            partitions (sparse_dist then traces the model once per run, not per partition).
    """

    make: Callable[..., TrainPipeline]
    cuda_only: bool = False
    why_cuda: str = ""
    restart_at_checkpoint: bool = False
    reusable: bool = False


def pipeline_problems(name: str, device_type: str) -> list[str]:
    """Why ``train.pipeline: name`` cannot run on ``device_type`` (empty when it can)."""
    factory = PIPELINES.get(name)
    if device_type != "cuda" and factory is not None and factory.cuda_only:
        return [f"train.pipeline: {name} needs CUDA: {factory.why_cuda}"]
    return []


class _Untimed:
    """What the trainer reads of a pipeline besides ``progress``: ``steps_done``,
    ``pop_times()`` (no breakdown for these pipelines) and ``detach()``."""

    steps_done = 0

    def pop_times(self) -> dict[str, float]:
        return {}


class BasePipeline(StageTimer, TrainPipelineBase):
    """``TrainPipelineBase`` with the stage timer of sampled steps (:mod:`recsys_dist.train.observe`):
    data, forward (input_dist, lookup, output_dist and the dense forward, one call here),
    backward, optimizer. It does not rewrite the model's forward; ``detach`` removes the
    forward hooks that time it (the next step puts them back)."""

    def __init__(self, model: torch.nn.Module, optimizer, device: torch.device, every_n: int | None = None) -> None:
        super().__init__(model, optimizer, device)
        self._init_timer(every_n)
        self._optimizer = _TimedStep(optimizer, self)
        self._t_forward = 0.0
        self._hooks: list = []

    def progress(self, dataloader_iter):
        if not self._hooks:  # first step, or the first after a detach (a validation mid-epoch)
            m = self._model
            self._hooks = [
                m.register_forward_pre_hook(self._forward_starts),
                m.register_forward_hook(self._forward_ends),
            ]
        return super().progress(dataloader_iter)

    def _forward_starts(self, *_) -> None:
        if self._times is not None:
            self._t_forward = self._now()

    def _forward_ends(self, *_) -> None:
        if self._times is not None:
            self._add("time_forward_ms", self._t_forward)

    def _next_batch(self, dataloader_iter):
        return self._timed("time_data_ms", super()._next_batch, dataloader_iter)

    def _backward(self, losses):
        return self._timed("time_backward_ms", super()._backward, losses)

    def detach(self) -> torch.nn.Module:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return self._model


class _TimedStep:
    """The optimizer as ``TrainPipelineBase`` calls it, its ``step`` timed on sampled steps."""

    def __init__(self, optimizer, pipe: BasePipeline) -> None:
        self._inner, self._pipe = optimizer, pipe

    def step(self, *args, **kwargs):
        return self._pipe._timed("time_optimizer_ms", self._inner.step, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class SemiSyncPipeline(_Untimed, TrainPipelineSemiSync):
    """``TrainPipelineSemiSync`` (CUDA), semi-synchronous from the first batch."""


class FusedSparseDistPipeline(_Untimed, TrainPipelineFusedSparseDist):
    """``TrainPipelineFusedSparseDist`` (CUDA)."""


PIPELINES: dict[PipelineName, PipelineFactory] = {
    "base": PipelineFactory(
        lambda model, opt, device, every_n: BasePipeline(model, opt, device, every_n), reusable=True
    ),
    "sparse_dist": PipelineFactory(
        lambda model, opt, device, every_n: TimedTrainPipeline(
            model,
            opt,
            device,
            execute_all_batches=True,
            every_n=every_n,
            # TorchRec's own sync of a DMPCollection every batch (default 1) is off: the replicas'
            # sync is the StepRunner's, every sharding.replica_sync_every steps (replicas.stepped).
            dmp_collection_sync_interval_batches=None,
        ),
        reusable=True,
    ),
    "semi_sync": PipelineFactory(
        lambda model, opt, device, _: SemiSyncPipeline(model, opt, device, execute_all_batches=True, start_batch=0),
        cuda_only=True,
        why_cuda="TrainPipelineSemiSync " + _RECORD + "; and its EmbeddingPipelinedForward takes the "
        "device to be cuda when there is no side stream (runtime_forwards.py: stream.device if stream else "
        "cuda), so it calls torch.cuda.current_stream() (Torch not compiled with CUDA enabled). Use "
        "sparse_dist or base on CPU",
        restart_at_checkpoint=True,
    ),
    "fused_sparse_dist": PipelineFactory(
        lambda model, opt, device, _: FusedSparseDistPipeline(model, opt, device, execute_all_batches=True),
        cuda_only=True,
        why_cuda="TrainPipelineFusedSparseDist.start_embedding_lookup " + _RECORD + ". Use sparse_dist or base on CPU",
    ),
}


def make_pipeline(
    name: str, model: torch.nn.Module, optimizer, device: torch.device, every_n: int | None = None
) -> TrainPipeline:
    """The pipeline ``train.pipeline`` names (:data:`PIPELINES`), over a DMP and its optimizer.

    Raises:
        ValueError: an unknown name, or one that cannot run on ``device`` (``cuda_only``).
    """
    if name not in PIPELINES:
        raise ValueError(f"train.pipeline: unknown pipeline {name!r}; one of {', '.join(PIPELINES)}")
    problems = pipeline_problems(name, device.type)
    if problems:
        raise ValueError(problems[0])
    return PIPELINES[name].make(model, optimizer, device, every_n)
