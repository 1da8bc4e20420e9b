"""The hooks a :class:`~recsys_dist.train.trainer.Trainer` calls: :class:`Callback` (public as
``recsys_dist.Callback``; ``recsys_dist.train.trainer.Callback`` is the same class)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# A hook's trainer: Any, so that a user's hook may annotate the public recsys_dist.Trainer (a subclass)
HookTrainer = Any


class Callback:
    """Hooks the :class:`Trainer` calls (``Trainer(callbacks=[...])``: subclass it and override what you need) on every rank, in the order of its
    ``callbacks`` list. They run inside the training loop: a collective in one must run on every
    rank (the Trainer calls each hook on every rank at the same point); an exception stops the run."""

    def on_step_end(self, trainer: HookTrainer, step: int, loss: torch.Tensor) -> None:
        """After optimizer step ``step`` (global, from 1; ``trainer.step`` equals it).

        ``loss``: this rank's training loss of the step, detached, times the batch's
        ``loss_scale`` (float32 scalar; ``[1 + T]`` with several tasks: the total, then each
        task's). Reading its value (``float(loss)``) waits for the step to finish; the
        global mean is in ``metrics.jsonl`` every ``train.log_every_n_steps``."""

    def on_validation_end(self, trainer: HookTrainer, step: int, metrics: dict[str, float]) -> None:
        """After each validation (every epoch's end and every ``eval.every_n_steps``), with the
        global metrics written to ``metrics.jsonl`` (the same dict on every rank)."""

    def on_checkpoint(self, trainer: HookTrainer, step: int, path: Path) -> None:
        """After the checkpoint of ``step`` was written, complete, to ``path`` (on every rank)."""

    def on_resume(self, trainer: HookTrainer, step: int, checkpoint: Path) -> None:
        """At ``fit``'s start in a run resumed from ``checkpoint`` (to finish what a kill cut short)."""

    def on_partition_end(self, trainer: HookTrainer, partition: str, checkpoint: Path | None) -> None:
        """A ``StreamTrainer`` trained ``partition``, then saved ``checkpoint`` (None: checkpoints off)."""
