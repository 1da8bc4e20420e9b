"""The Trainer's step runner: the pipelined step (forward, backward, optimizer) and its state.

:class:`StepRunner` holds what one training step needs between steps: the TorchRec pipeline
(``train.pipeline``, ``recsys_dist.train.pipelines``; under ``distributed.dense.strategy:
pipeline`` its stages' step, ``recsys_dist.train.stage_pipeline``: reused across epochs / partitions when it
ran its iterator dry, restarted after a mid-epoch checkpoint when its queued batches would hold
stale state), the MLPerf LR schedule (``train.warmup_steps`` ...) or a user ``lr_scheduler``.
The :class:`~recsys_dist.train.trainer.Trainer` owns the step count and asks it for each step.
"""

from __future__ import annotations

import warnings

import torch

from recsys_dist.distributed import replicas
from recsys_dist.train.config import TrainConfig
from recsys_dist.train.pipelines import PIPELINES, TrainPipeline, make_pipeline
from recsys_dist.train.schedule import LRSchedule
from recsys_dist.train.stage_pipeline import StagePipeline


class StepRunner:
    """Runs the training steps of one sharded model and optimizer.

    Args:
        model: the sharded model (``DistributedModelParallel``).
        optimizer: its ``CombinedOptimizer`` (dense and fused embedding optimizers).
        device: the rank's device.
        train: the ``train:`` section (``pipeline``, ``timing_every_n_steps``, the LR schedule).
        lr_scheduler: ``Trainer(lr_scheduler=...)``'s scheduler over the dense optimizer, or None.

    Attributes:
        pipe: the pipeline of the epoch / partition being trained (None before the first).
        schedule: the MLPerf LR schedule of ``train`` (``active`` False without one).
    """

    def __init__(self, model, optimizer, device: torch.device, train: TrainConfig, lr_scheduler=None) -> None:
        self.model, self.optimizer, self.device, self.train = model, optimizer, device, train
        self.lr_scheduler = lr_scheduler
        self.schedule = LRSchedule(train.warmup_steps, train.decay_start_step, train.decay_steps)
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.pipe: TrainPipeline | None = None
        self.drained = False  # the last epoch's pipeline ran its iterator dry (it may be reused)

    def start(self, step: int) -> TrainPipeline:
        """The pipeline of the next epoch (or stream partition), at global ``step``: the last one
        when it ran its iterator dry (no batch in flight; reset for a new iterator), so that its
        set-up (the model's trace) is paid once per run, not per partition; else a new one."""
        pipe = self.pipe
        if pipe is None or not self.drained or not (self._staged or PIPELINES[self.train.pipeline].reusable):
            pipe = self._new(step)
        else:
            pipe.reset()
            pipe.steps_done = step
        self.pipe, self.drained = pipe, False
        return pipe

    def progress(self, batches, step: int):
        """Train step ``step + 1`` on the next batch of ``batches``: the pipeline's output
        ``(loss, logits, labels, weights)``, or None when ``batches`` ran dry (nothing in flight)."""
        if self.schedule.active:
            self.schedule.apply(self.optimizer, self.base_lrs, step)
            # FBGEMM takes a new rate at its optimizer's step(), which only sets the rate;
            # calling it now makes this step's fused update use it.
            self.model.fused_optimizer.step()
        try:
            return self.pipe.progress(batches)
        except StopIteration:
            self.drained = True  # nothing in flight: the next epoch / partition may reuse it
            return None

    def after_step(self) -> None:
        """After every training step: the replicas' sync when due (``sharding.replica_groups``:
        every ``replica_sync_every`` steps, before the next batch's lookup), then a user LR
        scheduler's step."""
        replicas.stepped(self.model)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    @property
    def _staged(self) -> bool:
        """``distributed.dense.strategy: pipeline``: the model's steps run through its stages."""
        return getattr(self.model, "dense_stages", None) is not None

    @property
    def restarts_at_checkpoint(self) -> bool:
        """Whether a mid-epoch checkpoint restarts the pipeline (``recsys_dist.train.pipelines``)."""
        return not self._staged and PIPELINES[self.train.pipeline].restart_at_checkpoint

    def restart(self, step: int) -> None:
        """Drop the batches in flight and start a new pipeline at ``step``."""
        self.pipe.detach()
        self.pipe = self._new(step)

    def detach(self) -> None:
        # Scoring needs the plain forward; inside the loop (a validation, or a callback's
        # evaluate / predict) the pipeline has rewritten it. Its next progress re-attaches.
        if self.pipe is not None:
            self.pipe.detach()
        replicas.settle(self.model)  # replica groups score one model: the steps since the last sync synced

    def replay_lr_scheduler(self, step: int) -> None:
        """Bring a user LR scheduler to the resumed ``step`` (its state follows from the step count)."""
        if self.lr_scheduler is None:
            return
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                self.lr_scheduler.step()

    def log_fields(self, step: int) -> dict:
        """The train line's fields of the steps up to ``step``: ``lr_scale`` (with a schedule)
        and the pipeline's sampled stage times since the last call."""
        lr = {"lr_scale": round(self.schedule.scale(step - 1), 6)} if self.schedule.active else {}
        return {**lr, **(self.pipe.pop_times() if self.pipe else {})}

    def _new(self, step: int) -> TrainPipeline:
        # Sampling counts global steps, so timed steps do not restart with each epoch.
        t = self.train
        if self._staged:  # distributed.dense.strategy: pipeline (train.pipeline does not apply)
            pipe = StagePipeline(self.model, self.optimizer, self.device)
            pipe.steps_done = step
            return pipe
        pipe = make_pipeline(t.pipeline, self.model, self.optimizer, self.device, t.timing_every_n_steps)
        pipe.steps_done = step
        return pipe
