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
    rank (the Trainer calls each hook on every rank at the same point); an exception stops the run.
    An exception raised by ``on_step_end``, ``on_validation_end`` or ``on_partition_end`` (on any
    rank) stops it without losing it: a checkpoint of the step is saved (with
    ``checkpoint.enabled``), then every rank raises: the exception on the rank(s) it came from,
    with a note naming the callback, the hook, the step and the checkpoint, ``RuntimeError``
    naming them on the others; ``resume="auto"`` continues (docs/robustness.md)."""

    def on_step_end(self, trainer: HookTrainer, step: int, loss: torch.Tensor) -> None:
        """After optimizer step ``step`` (global, from 1; ``trainer.step`` equals it).

        ``loss``: this rank's training loss of the step, detached, times the batch's
        ``loss_scale`` (float32 scalar; ``[1 + T]`` with several tasks: the total, then each
        task's). Reading its value (``float(loss)``) waits for the step to finish; the
        global mean is in ``metrics.jsonl`` every ``train.log_every_n_steps``.

        An exception here is raised on every rank after the step (at an epoch's or a
        partition's last step: after its validation and checkpoint) is saved. A Trainer one of
        whose callbacks (on any rank) overrides this hook checks every step: one all_reduce of
        one int."""

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
        """A ``StreamTrainer`` trained ``partition``, then saved ``checkpoint`` (None: checkpoints off).
        An exception here is raised on every rank (the partition's checkpoint holds the step)."""


class Hooks:
    """A Trainer's callbacks, called in order on every rank.

    ``on_validation_end`` gets its own copy of the metrics (a callback that edits it changes
    neither ``metrics.jsonl`` nor the summary). An exception raised by ``on_validation_end``,
    ``on_step_end`` or ``on_partition_end`` is held (this rank's later callbacks of that hook
    are skipped; the validation's line, best / early-stopping state and checkpoint go on as in
    a run without it) until the Trainer has reached a point it can stop at:
    :meth:`raise_failure`, collective, then saves the step and raises on every rank.
    """

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)
        # (callback, hook name, step, exception): held until raise_failure
        self.failure: tuple[Callback, str, int, Exception] | None = None
        self._resumed = False
        self._step_checks: bool | None = None  # whether any rank's callback has an on_step_end

    def resume(self, trainer: HookTrainer, step: int, checkpoint: Path) -> None:
        """``on_resume``, once per Trainer (its first ``fit``)."""
        if not self._resumed:
            self._resumed = True
            for callback in self.callbacks:
                callback.on_resume(trainer, step, checkpoint)

    def _call(self, hook: str, step: int, *args) -> None:
        """Each callback's ``hook``; an ``Exception`` held (the first one until raised) and this
        call's later callbacks skipped (see the class doc)."""
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(*args)
            except Exception as err:  # noqa: BLE001 - raised by raise_failure, on every rank
                self.failure = self.failure or (callback, hook, step, err)
                return

    def step_end(self, trainer: HookTrainer, step: int, loss: torch.Tensor, check: bool = True) -> None:
        """``on_step_end`` of each callback; with ``check``, then :meth:`raise_failure` when any
        rank's callbacks have an ``on_step_end`` (agreed once, collectively: then one
        all_reduce of one int per step). ``check`` False (an epoch's or a partition's last
        step): a held exception is raised after its validation and checkpoint, or the
        partition's checkpoint, by the caller's ``raise_failure``."""
        self._call("on_step_end", step, trainer, step, loss)
        if check and self._checks_steps(trainer.ctx):
            self.raise_failure(trainer)

    def _checks_steps(self, ctx) -> bool:
        if self._step_checks is None:
            mine = any(type(c).on_step_end is not Callback.on_step_end for c in self.callbacks)
            self._step_checks = _any_rank(ctx, mine)  # callbacks may differ between ranks
        return self._step_checks

    def validation_end(self, trainer: HookTrainer, step: int, metrics: dict[str, float]) -> None:
        """``on_validation_end`` of each callback with a copy of ``metrics``; an ``Exception``
        is held for :meth:`raise_failure`."""
        for callback in self.callbacks:
            try:
                callback.on_validation_end(trainer, step, dict(metrics))
            except Exception as err:  # noqa: BLE001 - raised by raise_failure, on every rank
                self.failure = self.failure or (callback, "on_validation_end", step, err)
                return

    def checkpoint(self, trainer: HookTrainer, step: int, path: Path) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(trainer, step, path)

    def partition_end(self, trainer: HookTrainer, partition: str, checkpoint: Path | None) -> None:
        """``on_partition_end`` of each callback, then :meth:`raise_failure` (collective)."""
        self._call("on_partition_end", trainer.step, trainer, partition, checkpoint)
        self.raise_failure(trainer)

    def raise_failure(self, trainer: HookTrainer) -> None:
        """When a held callback exception exists on any rank: a checkpoint of the step (unless
        one holds it, or ``checkpoint.enabled`` is false), then every rank raises: the rank(s)
        whose callback raised its exception (a note naming the callback, its hook and step, and
        the checkpoint), the others ``RuntimeError`` naming them. Collective: one all_reduce of
        one int when there are several ranks (and a gather of the messages once one failed), so
        no rank is left waiting in a collective."""
        ctx, step = trainer.ctx, trainer.step
        mine = None
        if self.failure is not None:
            callback, hook, at, err = self.failure
            mine = (at, f"{type(callback).__name__}.{hook} raised {type(err).__name__}: {err}")
        if not _any_rank(ctx, mine is not None):
            return
        failed = [(0, mine)]
        if ctx.world_size > 1:
            failed = [None] * ctx.world_size
            dist.all_gather_object(failed, (ctx.rank, mine))
        failed = [(rank, what) for rank, what in failed if what is not None]
        saved = _save_step(trainer)
        where = (
            f"the run's state at step {step} is in checkpoint {saved}: continue with resume='auto' (--resume auto)"
            if saved is not None
            else "checkpoint.enabled is false: nothing was saved"
        )
        ranks = ", ".join(str(rank) for rank, _ in failed)
        if self.failure is not None:
            callback, hook, at, err = self.failure
            self.failure = None
            err.add_note(
                f"recsys_dist: raised by callback {type(callback).__name__}.{hook} at step {at} on "
                f"rank(s) {ranks}; every rank stopped; {where}"
            )
            raise err
        at, what = failed[0][1]
        raise RuntimeError(f"a callback failed on rank(s) {ranks} at step {at} ({what}); every rank stopped; {where}")


def _any_rank(ctx, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (one all_reduce of one int on several ranks)."""
    if ctx.world_size == 1:
        return flag
    nccl = dist.get_backend() == "nccl"
    t = torch.tensor([int(flag)], dtype=torch.int32, device="cuda" if nccl else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


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
