"""What ``Trainer(callbacks=[...])`` calls: subclass :class:`Callback` and override what you need."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from recsys_dist.trainer import Trainer


class Callback:
    """Hooks the :class:`~recsys_dist.trainer.Trainer` calls on every rank, in the order of its
    ``callbacks`` list. They run inside the training loop: a collective in one must run on every
    rank (the Trainer calls each hook on every rank at the same point); an exception stops the run."""

    def on_step_end(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        """After optimizer step ``step`` (global, from 1; ``trainer.step`` equals it).

        ``loss``: this rank's training loss of the step, detached, times the batch's
        ``loss_scale`` (float32 scalar; ``[1 + T]`` with several tasks: the total, then each
        task's). Reading its value (``float(loss)``) waits for the step to finish; the
        global mean is in ``metrics.jsonl`` every ``train.log_every_n_steps``."""

    def on_validation_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """After each validation (every epoch's end and every ``eval.every_n_steps``), with the
        global metrics written to ``metrics.jsonl`` (the same dict on every rank)."""
