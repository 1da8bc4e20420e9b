"""``distributed.dense.schedule: 2bw``: PipeDream-2BW's weight update around a stock schedule.

PipeDream-2BW (Narayanan, Phanishayee, Shi, Chen, Zaharia, "Memory-Efficient Pipeline-Parallel
DNN Training", ICML 2021, section 3.1) keeps two versions of each stage's weights and applies
each batch's gradient, accumulated over its microbatches, with one version of delay::

    W(t+1) = W(t) - lr * grad f(W(t-1))          (the paper's update; W(-1) = W(0))

:class:`TwoBW` is that rule around torch's ``Schedule1F1B``: a step's microbatches run 1F1B's
order on this stage's previous weights W(t-1) (swapped into the stage's parameters for the
schedule's ``step``), then the parameters are W(t) again and the optimizer applies that gradient
to them. A stateful optimizer (Adagrad's sum, Adam's moments) takes the stale gradient as its
gradient: its state is built from grad f(W(t-1)), as in 2BW. The schedule flushes every step
(all microbatches' backwards before the update), so this is 2BW's numerics, not its flush-free
throughput (docs/design/pipeline.md says why).

Only the tower (the pipeline's stages) is delayed. The embedding tables before it are updated
by TorchRec's fused optimizers inside the backward of the step that used them (and replicated
tables by the same optimizer step as under ddp), with the gradient that flows back through the
stale tower: the paper pipelines the whole model, tables included, but here the tables are not
in the pipeline (their forward and backward are collectives over every rank, outside the stages),
and keeping a second version of a sharded table would double its memory, which is what the
tower's copy costs here.
"""

from __future__ import annotations

import torch
from torch import nn

# The checkpoint entry holding each stage's W(t-1), by parameter name (recsys_dist.train.checkpointing).
STALE_KEY = "dense_stale"


class TwoBW:
    """A stock single-stage schedule whose ``step`` runs on this stage's previous weights.

    Args:
        schedule: torch's ``Schedule1F1B`` over this rank's ``PipelineStage``.
        params: this stage's parameters by their name in the model (the checkpoint's keys).

    Attributes:
        stale: per parameter, W(t-1) between steps (same shape, dtype and device); a second
            copy of the stage's parameters (the 2 in 2BW).
        fresh: True until the first step, or after :meth:`reset`: the next step takes
            W(t-1) = W(t) (the paper's W(-1) = W(0)); False once :attr:`stale` holds a version
            (after a step, or loaded from a 2bw checkpoint).
    """

    def __init__(self, schedule, params: dict[str, nn.Parameter]) -> None:
        self.schedule = schedule
        self.names = list(params)
        self.params = list(params.values())
        self.stale = [p.detach().clone() for p in self.params]
        self.fresh = True

    def step(self, *args, **kwargs):
        """The inner schedule's ``step`` on W(t-1); on return the parameters hold W(t) again,
        their ``.grad`` grad f(W(t-1)), and :attr:`stale` W(t) (the next step's previous
        version). Same arguments and result as the inner ``step``."""
        if self.fresh:
            self.reset_to_current()
        self._swap()  # parameters: W(t-1); stale: W(t). No autograd graph spans the swap.
        try:
            out = self.schedule.step(*args, **kwargs)
        finally:
            self._swap()
        with torch.no_grad():
            for s, p in zip(self.stale, self.params, strict=True):
                s.copy_(p)  # W(t-1) is no longer needed: the next step runs on W(t)
        return out

    def _swap(self) -> None:
        for i, p in enumerate(self.params):
            p.data, self.stale[i] = self.stale[i], p.data

    def reset_to_current(self) -> None:
        """W(t-1) := W(t) now (the weights were put back from elsewhere: a checkpoint without
        the previous version, the best weights kept in memory)."""
        with torch.no_grad():
            for s, p in zip(self.stale, self.params, strict=True):
                s.copy_(p)
        self.fresh = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter name -> W(t-1) (views: loading into them in place restores it)."""
        if self.fresh:
            self.reset_to_current()
        return dict(zip(self.names, self.stale, strict=True))


def two_bw_of(model) -> TwoBW | None:
    """The :class:`TwoBW` schedule of a sharded model, or None (not ``schedule: 2bw``)."""
    stages = getattr(model, "dense_stages", None)
    schedule = getattr(stages, "schedule", None)
    return schedule if isinstance(schedule, TwoBW) else None


def stale_state(model) -> dict:
    """The checkpoint entry of a 2bw model: ``{STALE_KEY: {name: W(t-1)}}`` of this rank's
    stage (the replicas of a stage in other pipelines write the same names and values; the
    checkpoint holds one), or ``{}`` for any other model."""
    two_bw = two_bw_of(model)
    return {STALE_KEY: two_bw.state_dict()} if two_bw is not None else {}


def fit_to_checkpoint(model, state: dict, saved_keys) -> None:
    """Before loading ``state`` (:func:`stale_state` inside it) from a checkpoint whose flat
    keys are ``saved_keys`` (``recsys_dist.checkpoint.safe_read.checkpoint_keys``): one that
    holds W(t-1) of every parameter of this stage (a 2bw checkpoint, whatever its world size or
    cut: the names are the model's) loads it; any other (ddp, fsdp, gpipe, 1f1b) is left out of
    ``state`` and 2bw starts afresh from the loaded weights (W(t-1) = W(t), as at the first
    step). No-op for a model that is not 2bw."""
    two_bw = two_bw_of(model)
    if two_bw is None or STALE_KEY not in state:
        return
    saved = set(saved_keys)
    if all(f"{STALE_KEY}.{n}" in saved for n in two_bw.names):
        two_bw.fresh = False  # the load fills stale in place
    else:
        del state[STALE_KEY]
        two_bw.fresh = True  # taken from the loaded weights at the next step
