"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic saves, resume, reshard.

Layout of a run directory's ``checkpoints/``::

    step_00000120/      one DCP checkpoint: every rank's shards, .metadata, meta.json
    latest              text file naming the newest complete checkpoint; written last

A checkpoint is written into ``step_N.tmp`` and renamed by rank 0 once every rank has
finished, and ``latest`` is replaced (write + rename) only after that, so a crash mid-save
never leaves a half-written checkpoint as the newest one.

What is saved: the model's sharded state dict (embedding shards, dense weights), the
optimizers' state (the fused embedding optimizer's per-row state as sharded tensors, the
dense optimizer's), the torch RNG state, and in ``meta.json`` the step, epoch, batches
consumed in the epoch, world size, sharding plan and resolved config. DCP stores tensors
with their global offsets, so a checkpoint loads onto any world size or sharding plan
(resharding); an entry the new model has but the checkpoint lacks is an error naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recsys_dist.distributed import DistContext
from recsys_dist.faults import maybe_fault


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model; the message says which."""


def save_checkpoint(ctx: DistContext, run_dir: Path, step: int, state: dict, meta: dict, keep: int = 2) -> Path:
    """Save ``state`` (nested dict of tensors / ShardedTensors) as checkpoint ``step``.

    Every rank must call this (it is collective). Keeps the newest ``keep`` checkpoints.
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
    maybe_fault("save", step, ctx.rank)
    if ctx.world_size > 1:
        dist.barrier()
    if ctx.is_main:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        marker = root / "latest.tmp"
        marker.write_text(final.name + "\n")
        marker.rename(root / "latest")
        for old in sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if ctx.world_size > 1:
        dist.barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None.

    Uses ``checkpoints/latest``; if that names a missing directory (deleted by hand), falls
    back to the newest ``step_*`` directory holding both ``.metadata`` and ``meta.json``.
    """
    root = Path(run_dir) / "checkpoints"
    marker = root / "latest"
    if marker.is_file():
        path = root / marker.read_text().strip()
        if is_complete(path):
            return path
    done = sorted(p for p in root.glob("step_*") if is_complete(p))
    return done[-1] if done else None


def is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(".tmp") and (path / ".metadata").is_file() and (
        path / "meta.json").is_file()


def read_meta(path: Path) -> dict:
    """``meta.json`` of a checkpoint. Raises CheckpointError when absent or unreadable."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        missing = [f for f in (".metadata", "meta.json") if not (path / f).is_file()]
        raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing")
    try:
        return json.loads((path / "meta.json").read_text())
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path}: meta.json is not valid JSON ({err})") from None


def load_checkpoint(path: Path, state: dict) -> None:
    """Load a checkpoint in place into ``state`` (the live model / optimizer state dicts).

    The target's sharding may differ from the one saved (resharding). Raises
    CheckpointError naming the entries that the checkpoint lacks or that differ in shape.
    """
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as err:  # noqa: BLE001 - DCP raises CheckpointException / RuntimeError / KeyError
        text = str(err)
        lines = [ln.strip() for ln in text.splitlines() if "Missing key" in ln or "size mismatch" in ln.lower()
                 or "shape" in ln.lower()]
        detail = "; ".join(dict.fromkeys(lines))[:1500] or text[:1500]
        raise CheckpointError(
            f"checkpoint {path} does not fit this model/optimizer: {detail}. A checkpoint resumes only "
            "the same model config (tables, dims, optimizers); sharding and world size may differ.") from None


# torch optimizers' state names -> the fused (FBGEMM) names, so a table's optimizer state
# is saved under one name whichever way it is sharded (data-parallel tables use torch
# optimizers; model-parallel ones FBGEMM's fused kernels).
_TORCH_TO_FUSED = {"sum": "momentum1", "exp_avg": "momentum1", "exp_avg_sq": "momentum2"}


def canonical_optimizer_state(optimizer_state: dict) -> dict:
    """``optimizer.state_dict()`` re-keyed so that fused and replicated tables agree.

    For every parameter: fused entries ``"<table>.momentum1"`` become ``"momentum1"``;
    torch entries ``sum`` / ``exp_avg`` / ``exp_avg_sq`` become ``momentum1`` / ``momentum2``,
    row-wise sums ``[rows, 1]`` are viewed as ``[rows]``; ``step`` counters are left out (the
    global step is in meta.json). Values are views of the live state, so loading a checkpoint
    into this dict in place restores the optimizers directly.
    """
    out = {}
    for param, entries in optimizer_state["state"].items():
        table = param.rsplit(".", 2)[-2] if param.endswith(".weight") else None
        canon = {}
        for name, value in entries.items():
            if name == "step":
                continue
            if table and name.startswith(table + "."):
                name = name[len(table) + 1:]
            name = _TORCH_TO_FUSED.get(name, name)
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == 1:
                value = value.view(-1)
            canon[name] = value
        if canon:
            out[param] = canon
    return out


def set_optimizer_steps(optimizer, step: int) -> None:
    """Set torch optimizers' ``step`` counters (not checkpointed) to the global step."""
    for state in optimizer.state.values():
        if isinstance(state, dict) and "step" in state and isinstance(state["step"], torch.Tensor):
            state["step"].fill_(step)
