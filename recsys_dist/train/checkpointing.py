"""The Trainer's checkpointer: its checkpoints' tensors, writing them, a resume's load, and
the best validation weights put back at the end (``train.early_stopping.restore_best``).

:class:`Checkpointer` saves the tensors (:func:`training_state`: weights, optimizer state, each
rank's RNG) with the ``meta.json`` the Trainer gives it (the position in the data is the data
source's, ``recsys_dist.train.data_source``) and pins the preprocessing record beside them
(:func:`pin_preprocessing`); writing is ``recsys_dist.checkpoint.dcp.save_checkpoint``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.compat import check_compatible
from recsys_dist.checkpoint.config import CheckpointConfig
from recsys_dist.checkpoint.dcp import (
    canonical_optimizer_state,
    load_checkpoint,
    save_checkpoint,
    set_optimizer_steps,
)
from recsys_dist.checkpoint.rng import fit_rng, restore_rng, rng_state
from recsys_dist.checkpoint.safe_read import checkpoint_keys
from recsys_dist.data.record import MANIFEST_FILE, Preprocessing
from recsys_dist.distributed import replicas
from recsys_dist.distributed.env import DistContext, broadcast_result
from recsys_dist.distributed.optim import init_lazy_state
from recsys_dist.distributed.two_bw import fit_to_checkpoint, stale_state, two_bw_of
from recsys_dist.train.best_weights import MemoryCopy, checkpoint_of_step
from recsys_dist.train.build import Loaders
from recsys_dist.train.early_stopping import BestTracker
from recsys_dist.train.job import Job
from recsys_dist.train.observe import PhaseClock

log = logging.getLogger("recsys_dist")


def training_state(model, optimizer, rank: int, device: torch.device) -> dict:
    """The state dicts a checkpoint saves and loads in place (views of the live tensors; the
    random state as ``recsys_dist.checkpoint.rng`` keeps it)."""
    return {
        "model": model.state_dict(),
        "optimizer": canonical_optimizer_state(optimizer.state_dict()),
        # One per rank: the ranks draw different dropout masks (a single "rng" entry would be
        # saved once, by one rank, and handed to every rank on resume).
        "rng": rng_state(rank, device),
        **stale_state(model),  # schedule: 2bw: each stage's previous weights W(t-1) (two_bw)
    }


def pin_preprocessing(job: Job, loaders: Loaders, path: Path) -> None:
    """Rank 0: how inputs are mapped (vocabulary, sizes, transforms) travels with the
    checkpoint ``path``, so export and predict never read the training data again
    (``recsys_dist.data.record``); a failure is a warning."""
    conversion = loaders.conversion
    manifest = json.loads((conversion / MANIFEST_FILE).read_text()) if conversion is not None else None
    try:
        Preprocessing.describe(job.data, job.fmt, loaders.num_embeddings, conversion, manifest).save(path)
    except OSError as err:  # the checkpoint is complete without it; scoring falls back to the cache
        log.warning("could not write the preprocessing record into %s (%s)", path, err)


class Checkpointer:
    """One rank's side of the run's checkpoints.

    Args:
        run_dir: the run directory (``checkpoints/`` below it).
        ctx: this rank's place in the job. clock: the run's wall-time split.
        model, optimizer: the sharded model and its ``CombinedOptimizer``.
        in_memory_best: keep the best validation's weights in memory (``restore_best`` with
            checkpoints off) instead of in a checkpoint.

    Attributes:
        saved_step, saved_path: the step and directory of the checkpoint written last (or
            resumed from, a stream's), None before one.
        weights_step: the step whose weights the model holds when restore_best put back an
            earlier one's, else None.
    """

    def __init__(
        self, run_dir: Path, ctx: DistContext, clock: PhaseClock, model, optimizer, in_memory_best: bool
    ) -> None:
        self.run_dir, self.ctx, self.clock, self.model, self.optimizer = run_dir, ctx, clock, model, optimizer
        self.saved_step: int | None = None
        self.saved_path: Path | None = None
        self.weights_step: int | None = None
        self.memory_best = MemoryCopy() if in_memory_best else None

    def due(self, cfg: CheckpointConfig, step: int, done: bool) -> bool:
        """Whether ``checkpoint.every_n_steps`` asks for a checkpoint at ``step`` (not the
        run's last, ``done``, which is saved at the end; not one already saved)."""
        every = cfg.every_n_steps
        return cfg.enabled and bool(every) and step % every == 0 and not done and self.saved_step != step

    def save(self, step: int, meta: dict, job: Job, source, best: bool = False) -> Path:
        """Write the checkpoint of ``step`` with ``meta`` (``checkpoint.keep`` kept; ``best``:
        marked ``checkpoints/best``), the files of the data ``source`` (a ``DataSource``:
        ``checkpoint_files``) and the preprocessing record (of its loaders); returns its directory."""
        replicas.settle(self.model)  # sharding.replica_groups: the replicas agree before they are saved
        state = training_state(self.model, self.optimizer, self.ctx.rank, self.ctx.device)
        files = source.checkpoint_files()
        path = save_checkpoint(self.ctx, self.run_dir, step, state, meta, job.checkpoint.keep, best=best, files=files)
        self.saved_step, self.saved_path = step, path
        if self.ctx.is_main:
            pin_preprocessing(job, source.loaders, path)
        return path

    def load(self, path: Path, meta: dict, job: Job, global_batch: int, sizes: list[int], user_model) -> None:
        """Check that ``job`` may resume checkpoint ``path`` (``meta``) and load its weights,
        optimizer state (and step) and, on the same world size, each rank's RNG, in place."""
        ctx = self.ctx
        run_dirs.check_stream_resume(path, meta, job.data.stream is not None, global_batch)
        check_compatible(
            path, meta, job.to_dict(), sizes=sizes, world_size=ctx.world_size, user_model=user_model is not None
        )
        init_lazy_state(self.optimizer, self.model.fused_optimizer)
        state = training_state(self.model, self.optimizer, ctx.rank, ctx.device)
        saved = checkpoint_keys(path)
        if meta.get("world_size") != ctx.world_size:  # no rank's random stream continues
            del state["rng"]
        fit_rng(state, saved)  # a CPU checkpoint resumed on CUDA: no device generator's state
        if two_bw_of(self.model) is not None:  # schedule 2bw: W(t-1) when the checkpoint holds one
            fit_to_checkpoint(self.model, state, saved)
        load_checkpoint(path, state, verify=False)  # verified in _setup; in place: the state dicts are views
        set_optimizer_steps(self.optimizer, meta["step"])
        restore_rng(state, ctx.rank, ctx.device)

    @staticmethod
    def warn_weights(path: Path, meta: dict) -> None:
        """A resumed checkpoint holds restore_best's weights, not its step's: training goes on from them."""
        log.warning(
            "checkpoint %s holds the weights of step %d, the best validation's (train.early_stopping."
            "restore_best), at step %d's data position: training on continues from those weights",
            path,
            meta["weights_step"],
            meta["step"],
        )

    def keep_best(self, step: int) -> None:
        """A new best validation at ``step`` with checkpoints off: its weights kept in memory."""
        if self.memory_best is not None:
            replicas.settle(self.model)
            self.memory_best.keep(self.model, step)

    def restore_best(self, best: BestTracker, step: int, resumed_from: Path | None) -> bool:
        """Put back the weights (and optimizer state) of ``best.best_step``, read from its
        checkpoint (the run's, or the one resumed from's run's) or from the copy in memory;
        False (a warning) when its checkpoint is gone. Collective."""
        if self.memory_best is not None and self.memory_best.step == best.best_step:
            self.memory_best.restore(self.model)
            if two_bw_of(self.model) is not None:  # 2bw: W(t-1) := the restored weights (none was kept)
                two_bw_of(self.model).fresh = True
            source = "memory"
        else:
            # The run's own, or (resumed from another run's checkpoint) that run's.
            roots = [self.run_dir / "checkpoints"] + ([resumed_from.parent] if resumed_from else [])
            path = broadcast_result(self.ctx, lambda: checkpoint_of_step(roots, best.best_step))
            if path is None:
                log.warning(
                    "train.early_stopping.restore_best: the checkpoint of the best validation (step %d) is in none "
                    "of %s (deleted?); the test split is scored and the final checkpoint saved with the last "
                    "weights (step %d)",
                    best.best_step,
                    ", ".join(map(str, roots)),
                    step,
                )
                return False
            with self.clock.phase("checkpoint"):
                init_lazy_state(self.optimizer, self.model.fused_optimizer)
                state = training_state(self.model, self.optimizer, self.ctx.rank, self.ctx.device)
                del state["rng"]  # the random streams go on from the last step
                if two_bw_of(self.model) is not None:
                    fit_to_checkpoint(self.model, state, checkpoint_keys(path))
                load_checkpoint(path, state)  # verified (checksums) by rank 0 first
                source = str(path)
        self.weights_step = best.best_step
        log.info(
            "restored the weights of step %d (best validation %s %.6g) from %s; trained to step %d",
            best.best_step,
            best.metric,
            best.best,
            source,
            step,
        )
        return True
