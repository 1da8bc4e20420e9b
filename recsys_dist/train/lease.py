"""What a Trainer holds while it lives: the process group (when it made it) and the run
directory's lock, and how it lets them go (:class:`RunLease`)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.distributed.config import DistributedConfig
from recsys_dist.distributed.env import DistContext, broadcast_result, check_reusable, init_distributed, note_failure


class RunLease:
    """The process group a Trainer trains on and the run directory it holds.

    When no group exists, it creates one (``recsys_dist.distributed.env.init_distributed``)
    and :meth:`release` destroys it; an existing group is used as it is and left to its owner
    (or taken over when a Trainer that failed on every rank left it open).

    Attributes:
        ctx: this rank's place in the job.
        failed: an error went through the Trainer on this rank (set by :meth:`collective`).
        closed: :meth:`release` ran.
    """

    def __init__(self, distributed: DistributedConfig) -> None:
        self.owns_group = not dist.is_initialized()
        self.closed = self.failed = False
        self.lock = None
        self.ctx: DistContext = init_distributed(distributed)
        self.group = dist.group.WORLD  # the group this Trainer trains on (it may outlive it)
        if not self.owns_group and check_reusable(self.ctx.rank, self.ctx.world_size):
            self.owns_group = True  # left open by a Trainer that failed on every rank: now ours to close

    def take_run_dir(self, run_dir: Path) -> None:
        """Rank 0 holds the run directory's lock until :meth:`release` (unless the launcher that
        started this process holds it); every rank raises if another run holds it, another
        Trainer of this process included (the lock is not handed down to it)."""
        # An elastic restart's new rank 0 may start while the previous one is still exiting.
        wait = 30.0 if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 else 0.0

        def take() -> None:
            self.lock = run_dirs.lock_run_dir(run_dir, wait_s=wait, hand_down=False)

        broadcast_result(self.ctx, take)

    @contextmanager
    def collective(self):
        """A collective call of the Trainer: refused when closed or its group is gone; an
        error marks the lease failed."""
        if self.closed:
            raise RuntimeError("this Trainer is closed")
        if not dist.is_initialized() or dist.group.WORLD is not self.group:
            # Its owner (the Trainer that made it, closed first, or the caller) destroyed it;
            # torch would only say that no default process group exists.
            raise RuntimeError(
                "the process group this Trainer was built on has been destroyed (by closing the "
                "Trainer that created it, or by torch.distributed.destroy_process_group()); close "
                "this Trainer and build a new one, or close Trainers in the reverse order of creation"
            )
        try:
            yield
        except BaseException:
            self.failed = True
            raise

    def release(self) -> None:
        """The lock, then the group when this lease made it (see ``Trainer.close``)."""
        if self.lock is not None:
            self.lock.release()
        if not dist.is_initialized() or dist.group.WORLD is not self.group:
            return  # already destroyed (a group made since then belongs to someone else)
        if self.failed and self.ctx.world_size > 1:
            note_failure(self.ctx.rank)  # what a next Trainer in these ranks checks (check_reusable)
        if not self.owns_group:
            return
        if not self.failed:
            # Every rank leaves its last collective before any rank tears down gloo; a rank that
            # exited while a peer still had work queued made the peer abort.
            dist.barrier()
        if not self.failed or self.ctx.world_size == 1:
            dist.destroy_process_group()
