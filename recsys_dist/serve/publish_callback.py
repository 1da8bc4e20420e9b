"""Publishing while training: the Trainer callback that turns ``publish:`` into versions.

:class:`PublishCallback` is a :class:`~recsys_dist.train.trainer.Callback` (publishing is a
plug-in of the serve layer; the Trainer only announces its checkpoints and, streaming, its
partitions). ``recsys-dist train`` adds it when ``publish.enabled``; a Python user adds it to
``Trainer(callbacks=[...])`` (a Trainer given ``publish.enabled`` without it refuses to start).
After the checkpoint of every ``publish.every_n_steps`` steps, or after each partition of a
stream (``publish.every_partition``), rank 0 publishes that checkpoint
(:class:`recsys_dist.serve.publish.Publisher`: a full version, then deltas) while the other
ranks wait; an error is raised on every rank. The weights published are the model's as the
ranks hold it in memory, gathered onto rank 0 (``recsys_dist.checkpoint.gather``): equal to the
checkpoint's, which is not read back. Publishing leaves the training's random stream as it
was: rank 0 builds and loads unsharded models to publish (their initialisation draws random
numbers), which would otherwise shift its dropout masks, so a resumed run (whose first publish
builds the model again) would train other numbers than the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from recsys_dist.checkpoint.gather import gather_full_state
from recsys_dist.checkpoint.integrity import describe_error
from recsys_dist.distributed.env import broadcast_result
from recsys_dist.errors import CheckpointError
from recsys_dist.faults import maybe_fault
from recsys_dist.serve.publish import Publisher, check_new_run, check_owner, resolve_publish_dir
from recsys_dist.serve.publish_owner import check_path
from recsys_dist.train.config import PublishConfig
from recsys_dist.train.trainer import Callback


class PublishCallback(Callback):
    """Publishes a run's checkpoints as ``publish:`` says (module docstring).

    Args:
        cfg: the ``publish:`` section (enabled).
        run_dir: the run directory (``publish.dir`` is relative to it; default ``RUN_DIR/publish``).

    Attributes:
        dir: the publish directory. publisher: rank 0's ``Publisher`` once it published (None before).
    """

    publishes = True  # what a Trainer with publish.enabled looks for among its callbacks

    def __init__(self, cfg: PublishConfig, run_dir: str | Path) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.dir = resolve_publish_dir(cfg, run_dir)
        self.publisher: Publisher | None = None

    def on_checkpoint(self, trainer, step: int, path: Path) -> None:
        n = self.cfg.every_n_steps
        if n is not None and step > 0 and step % n == 0:
            self._publish(trainer, path)

    def on_partition_end(self, trainer, partition: str, checkpoint: Path | None) -> None:
        if self.cfg.every_partition and checkpoint is not None:
            self._publish(trainer, checkpoint)

    def on_resume(self, trainer, step: int, checkpoint: Path) -> None:
        # A run killed (or failing to publish) between a checkpoint and its publish resumes from
        # that checkpoint: publish it now unless it already was (its last partition's version).
        n = self.cfg.every_n_steps
        due = n is not None and step > 0 and step % n == 0
        stream = getattr(trainer, "stream", None)
        due = due or (self.cfg.every_partition and stream is not None and stream.current is None and stream.consumed)
        if due:
            self._publish(trainer, checkpoint, unless_published=step)

    def _publish(self, trainer, checkpoint: Path, unless_published: int | None = None) -> None:
        # The model as the ranks hold it is the checkpoint's (just saved, or just resumed from):
        # rank 0 publishes it from memory instead of reading the checkpoint back.
        with trainer.clock.phase("publish"):
            state = gather_full_state(trainer.model.state_dict())

        def publish() -> Path | None:
            with torch.random.fork_rng(devices=[]):  # the training's RNG is not the publisher's
                return publish_unforked()

        def publish_unforked() -> Path | None:
            try:
                if self.publisher is None:
                    # Versions past the step this run started from are trained again: moved aside.
                    # No run takes another run's versions (publish.overwrite): from scratch, or resumed.
                    step = trainer.resumed_at_step
                    self.publisher = Publisher(
                        self.dir, self.cfg, resume_step=step or 0, lock=True, new_run=step is None, run_dir=self.run_dir
                    )
                if unless_published is not None and self.publisher.step == unless_published:
                    return None
                maybe_fault("publish", trainer.step, trainer.ctx.rank)
                return self.publisher.publish(checkpoint, state)
            except CheckpointError as err:
                raise _on_every_rank(err, trainer.ctx.rank, self.run_dir) from None
            except OSError as err:  # the directory itself (created, locked, cleaned) cannot be written
                failure = CheckpointError(f"publish: {self.dir} cannot be written ({describe_error(err)})")
                failure.resumable = True
                raise _on_every_rank(failure, trainer.ctx.rank, self.run_dir) from None

        with trainer.clock.phase("publish"):
            broadcast_result(trainer.ctx, publish)


def _on_every_rank(err: CheckpointError, rank: int, run_dir: Path) -> CheckpointError:
    """``err`` of the publishing rank as every rank raises it: reported once, naming that rank
    (``origin_rank``: the others do not record it for the launcher) and, for a version that
    could not be written, how to continue."""
    text = f"rank {rank} (the rank that publishes): {err}"
    if getattr(err, "resumable", False):
        text += (
            f"; then continue with --resume auto --run-dir {run_dir} (that checkpoint is kept: the resumed run "
            "publishes it first)"
        )
    out = CheckpointError(text)
    out.every_rank, out.origin_rank = True, rank
    return out


def check_publish_dir(cfg: PublishConfig, run_dir: str | Path, resumed: bool) -> None:
    """Before a run starts (``recsys-dist train``, before any rank), what its Publisher would
    refuse at the first publish, after training up to it: a ``publish.dir`` that is a file or
    holds a planted ``.lock`` / ``manifest.json`` (``publish_dir.check_path``); another run's
    versions there, for a run from scratch (``resumed`` False: ``publish_dir.check_new_run``)
    or a resumed one (``publish_dir.check_owner``), unless ``publish.overwrite``.

    Raises:
        CheckpointError: such a directory, named with the fixes.
    """
    if not cfg.enabled:
        return
    d = resolve_publish_dir(cfg, run_dir)
    check_path(d)
    if resumed:
        check_owner(d, cfg, run_dir)
    else:
        check_new_run(d, cfg)
