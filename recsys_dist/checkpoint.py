"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout of a run directory's ``checkpoints/``::

    step_00000120/      one DCP checkpoint: every rank's shards plus .metadata
    latest              text file naming the newest complete checkpoint; written last

A checkpoint is written into ``step_N.tmp`` and renamed by rank 0 once every rank has
finished, so a crash mid-save never leaves a half-written checkpoint as the newest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recsys_dist.distributed import DistContext


def save_checkpoint(ctx: DistContext, run_dir: Path, step: int, state: dict, meta: dict) -> Path:
    """Save ``state`` (model and optimizer state dicts, sharded) as checkpoint ``step``.

    Args:
        state: nested dict of tensors / ShardedTensors / DTensors, e.g.
            ``{"model": dmp.state_dict(), "optimizer": opt.state_dict()}``.
        meta: JSON-serialisable facts (step, epoch, plan, config) stored as meta.json.

    Returns the final checkpoint directory.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if ctx.world_size > 1:
        dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if ctx.world_size > 1:
        dist.barrier()
    if ctx.is_main:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        marker = root / "latest.tmp"
        marker.write_text(final.name + "\n")
        marker.rename(root / "latest")
    if ctx.world_size > 1:
        dist.barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint named by ``checkpoints/latest``, or None."""
    marker = Path(run_dir) / "checkpoints" / "latest"
    if not marker.is_file():
        return None
    path = marker.parent / marker.read_text().strip()
    return path if path.is_dir() else None
