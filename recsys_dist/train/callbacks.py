"""The hooks a :class:`~recsys_dist.train.trainer.Trainer` calls: :class:`Callback` (public as
``recsys_dist.Callback``; ``recsys_dist.train.trainer.Callback`` is the same class), and
:class:`Hooks`, how the Trainer calls them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recsys_dist.checkpoint.dcp import latest_checkpoint
from recsys_dist.checkpoint.run_dir import checkpoint_step
from recsys_dist.distributed.env import broadcast_result

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
        """After each validation (every epoch's end and every ``eval.every_n_steps``; a
        ``StreamTrainer``: each partition scored before training), with the global metrics
        written to ``metrics.jsonl`` (equal on every rank; a copy per callback: editing it
        changes neither the file nor the summary).

        An exception here stops the run without losing it: the validation's line, best /
        early-stopping state and checkpoints go on as without it, a checkpoint of the step is
        saved (with ``checkpoint.enabled``; after ``fit``'s last validation: its test split,
        final checkpoint and ``summary.json`` first), then every rank raises: the exception on
        the rank(s) it came from (with a note naming the callback, the step and the
        checkpoint), ``RuntimeError`` naming them on the others. ``resume="auto"`` continues."""

    def on_checkpoint(self, trainer: HookTrainer, step: int, path: Path) -> None:
        """After the checkpoint of ``step`` was written, complete, to ``path`` (on every rank)."""

    def on_resume(self, trainer: HookTrainer, step: int, checkpoint: Path) -> None:
        """At the first ``fit``'s start in a run resumed from ``checkpoint`` (to finish what a kill
        cut short); not again at a later ``fit`` of the same Trainer."""

    def on_partition_end(self, trainer: HookTrainer, partition: str, checkpoint: Path | None) -> None:
        """A ``StreamTrainer`` trained ``partition``, then saved ``checkpoint`` (None: checkpoints off)."""


class Hooks:
    """A Trainer's callbacks, called in order on every rank.

    ``on_validation_end`` gets its own copy of the metrics (a callback that edits it changes
    neither ``metrics.jsonl`` nor the summary). An exception one raises is held (the
    validation's line, best / early-stopping state and checkpoint go on as in a run without
    it; this rank's later callbacks of that validation are skipped) until the Trainer has
    reached a point it can stop at: :meth:`raise_failure`, collective, then saves the step and
    raises on every rank.
    """

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)
        self.failure: tuple[Callback, Exception] | None = None  # held by validation_end
        self._resumed = False

    def resume(self, trainer: HookTrainer, step: int, checkpoint: Path) -> None:
        """``on_resume``, once per Trainer (its first ``fit``)."""
        if not self._resumed:
            self._resumed = True
            for callback in self.callbacks:
                callback.on_resume(trainer, step, checkpoint)

    def step_end(self, trainer: HookTrainer, step: int, loss: torch.Tensor) -> None:
        for callback in self.callbacks:
            callback.on_step_end(trainer, step, loss)

    def validation_end(self, trainer: HookTrainer, step: int, metrics: dict[str, float]) -> None:
        """``on_validation_end`` of each callback with a copy of ``metrics``; an ``Exception``
        is held for :meth:`raise_failure`."""
        for callback in self.callbacks:
            try:
                callback.on_validation_end(trainer, step, dict(metrics))
            except Exception as err:  # noqa: BLE001 - raised by raise_failure, on every rank
                self.failure = (callback, err)
                return

    def checkpoint(self, trainer: HookTrainer, step: int, path: Path) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(trainer, step, path)

    def partition_end(self, trainer: HookTrainer, partition: str, checkpoint: Path | None) -> None:
        for callback in self.callbacks:
            callback.on_partition_end(trainer, partition, checkpoint)

    def raise_failure(self, trainer: HookTrainer) -> None:
        """When an ``on_validation_end`` raised on any rank: a checkpoint of the step (unless
        one holds it, or ``checkpoint.enabled`` is false), then every rank raises: the rank(s)
        whose callback raised its exception (a note naming the callback, the step and the
        checkpoint), the others ``RuntimeError`` naming them. Collective (one gather of a
        few bytes when there are several ranks), so no rank is left waiting in a collective."""
        ctx, step = trainer.ctx, trainer.step
        mine = None
        if self.failure is not None:
            callback, err = self.failure
            mine = f"{type(callback).__name__}.on_validation_end raised {type(err).__name__}: {err}"
        failed = [(0, mine)]
        if ctx.world_size > 1:
            failed = [None] * ctx.world_size
            dist.all_gather_object(failed, (ctx.rank, mine))
        failed = [(rank, what) for rank, what in failed if what is not None]
        if not failed:
            return
        saved = _save_step(trainer)
        where = (
            f"the run's state at step {step} is in checkpoint {saved}: continue with resume='auto' (--resume auto)"
            if saved is not None
            else "checkpoint.enabled is false: nothing was saved"
        )
        ranks = ", ".join(str(rank) for rank, _ in failed)
        if self.failure is not None:
            callback, err = self.failure
            self.failure = None
            err.add_note(
                f"recsys_dist: raised by callback {type(callback).__name__}.on_validation_end at step {step} on "
                f"rank(s) {ranks}; every rank stopped; {where}"
            )
            raise err
        raise RuntimeError(
            f"a callback failed on rank(s) {ranks} at step {step} ({failed[0][1]}); every rank stopped; {where}"
        )


def _save_step(trainer: HookTrainer) -> Path | None:
    """The checkpoint of the trainer's step for a run a callback stopped: the one saved (or
    resumed from) at it, else a new one; None with checkpoints off. Collective."""
    if not trainer.job.checkpoint.enabled:
        return None
    if trainer._ckpt.saved_step != trainer.step:
        latest = broadcast_result(trainer.ctx, lambda: latest_checkpoint(trainer.run_dir))
        if latest is not None and checkpoint_step(latest) == trainer.step:
            return latest  # resumed from it, nothing trained since (a stream scoring its next partition)
        trainer._save_in_window()
    return trainer._ckpt.saved_path
