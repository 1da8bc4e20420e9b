"""Checkpoints for your own training loop (``recsys_dist.save_checkpoint`` / ``load_checkpoint``).

The Trainer's checkpoints with public arguments only: the model (the DistributedModelParallel
of :func:`recsys_dist.shard`, or any module), its optimizers and your loop's position, written
with torch.distributed.checkpoint into ``RUN_DIR/checkpoints/step_N`` as the Trainer writes
them (atomic, ``latest`` marker, the newest ``keep`` kept; every rank's shards), and loaded
onto any world size or sharding plan. The process group is the one ``torch.distributed`` has
(none: one process).

What is saved: ``model.state_dict()`` (embedding shards, dense weights); the fused embedding
optimizer's state (``model.fused_optimizer``, the per-row state of ``apply_optimizer_in_backward``);
the state of ``optimizer`` (a ``torch.optim.Optimizer`` over the model's parameters, e.g. the
dense part, or a TorchRec ``KeyedOptimizer`` / ``CombinedOptimizer``); each rank's torch RNG
state; and in ``meta.json`` the step, the world size, the sharding plan and ``extra`` (yours:
the epoch and batch to continue from, an LR scheduler's ``state_dict()``, ...; JSON).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import KeyedOptimizer

from recsys_dist.checkpoint import dcp as ckpt
from recsys_dist.checkpoint.meta import named_checkpoint, read_meta
from recsys_dist.checkpoint.rng import fit_rng, restore_rng, rng_state
from recsys_dist.checkpoint.safe_read import checkpoint_keys
from recsys_dist.distributed import replicas
from recsys_dist.distributed.env import DistContext
from recsys_dist.distributed.optim import init_lazy_state
from recsys_dist.distributed.plan_io import plan_summary
from recsys_dist.errors import CheckpointError


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` read besides the tensors: the checkpoint directory, the
    step it was saved at, the world size that saved it and the ``extra`` saved with it."""

    path: Path
    step: int
    world_size: int
    extra: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Save ``model`` and its optimizers as ``run_dir/checkpoints/step_{step:08d}``. Collective:
    every rank calls it with the same ``run_dir`` and ``step``.

    Args:
        run_dir: the run directory (``checkpoints/`` is made in it).
        model: what :func:`recsys_dist.shard` returned (a DistributedModelParallel; its
            ``fused_optimizer`` state is saved too; a ``ReplicaDMP`` syncs its replicas first),
            or any ``nn.Module``.
        optimizer: your optimizer of the rest of the parameters (a ``torch.optim.Optimizer``
            over parameters of ``model``, or a TorchRec ``KeyedOptimizer``), or None.
        step: the number of optimizer steps taken (>= 0); names the checkpoint.
        extra: JSON-serialisable values to get back from :func:`load_checkpoint` (identical on
            every rank; rank 0's is written), e.g. ``{"epoch": 1, "batch": 20}``.
        keep: keep the newest ``keep`` checkpoints of ``run_dir``, delete older ones.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: ``extra`` is not JSON-serialisable, ``step`` < 0, or ``optimizer`` holds
            a parameter that is not ``model``'s.
        CheckpointError: on every rank, when any rank cannot write (disk full, read-only
            directory); the previous checkpoint is left as it was.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"extra must be JSON-serialisable: {err}") from None
    ctx = _context(model)
    replicas.settle(model)  # sharding.replica_groups: the replicas agree first (else one group's would be saved)
    meta = {"step": step, "world_size": ctx.world_size, "extra": extra_json, "own_loop": True}
    if getattr(model, "plan", None) is not None:
        meta["plan"] = plan_summary(model.plan)  # type: ignore[arg-type]
    state = _state(model, optimizer, ctx)
    return ckpt.save_checkpoint(ctx, Path(run_dir), step, state, meta, keep=keep)


def load_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> LoadedCheckpoint:
    """Load a checkpoint of :func:`save_checkpoint` into ``model`` and ``optimizer`` in place.
    Collective: every rank calls it with the same ``path``.

    The world size and sharding plan may differ from the ones that saved it (resharding); the
    RNG state is restored only at the same world size. Build ``model`` and ``optimizer`` as for
    the run that saved it (the same tables, dims, optimizers), then call this before the first step.

    Args:
        path: a checkpoint directory, or a run directory (its newest complete checkpoint).
        model, optimizer: as given to :func:`save_checkpoint`.

    Returns:
        :class:`LoadedCheckpoint` with ``step`` and ``extra`` to continue the loop from.

    Raises:
        CheckpointError: no complete checkpoint at ``path``; one that is damaged; or one that
            lacks an entry of this model / optimizer or holds it in another shape (naming it).
    """
    where = Path(path)
    if where.is_dir() and not (where / "checkpoints").is_dir() and not (where / ".metadata").exists():
        raise CheckpointError(
            f"{where}: no complete checkpoint there (neither a checkpoint directory nor a run directory "
            "with checkpoints/); save_checkpoint(run_dir, ...) writes run_dir/checkpoints/step_N"
        )
    found = named_checkpoint(where)
    meta = read_meta(found)
    ctx = _context(model)
    saved = checkpoint_keys(found)
    _init_optimizer_state(model, optimizer, saved)
    state = _state(model, optimizer, ctx)
    # Entries of the optimizer state that the saved run had not created yet (a step-0 checkpoint
    # of Adam) stay as they are; everything else must be in the checkpoint.
    state["optimizer"] = {
        name: entries
        for name, entries in state["optimizer"].items()
        if any(k.startswith(f"optimizer.{name}.") for k in saved)
    }
    if meta.get("world_size") != ctx.world_size:
        del state["rng"]  # no rank's random stream continues
    fit_rng(state, saved)  # a CPU checkpoint resumed on CUDA: no device generator's state
    ckpt.load_checkpoint(found, state)
    restore_rng(state, ctx.rank, ctx.device)
    if isinstance(optimizer, KeyedOptimizer):
        ckpt.set_optimizer_steps(optimizer, meta["step"])  # not saved in the canonical form
    return LoadedCheckpoint(found, int(meta["step"]), int(meta.get("world_size", 1)), meta.get("extra") or {})


def _context(model: nn.Module) -> DistContext:
    on = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        device=device,
        backend=dist.get_backend() if on else "none",
    )


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: DistContext) -> dict:
    opt_state: dict[str, dict] = {}
    fused = getattr(model, "fused_optimizer", None)
    if isinstance(fused, KeyedOptimizer):
        opt_state.update(ckpt.canonical_optimizer_state(fused.state_dict()))
    if isinstance(optimizer, KeyedOptimizer):
        opt_state.update(ckpt.canonical_optimizer_state(optimizer.state_dict()))
    elif optimizer is not None:
        opt_state.update(_named_state(model, optimizer))
    return {
        "model": model.state_dict(),
        "optimizer": opt_state,
        # One per rank: ranks draw different dropout masks.
        "rng": rng_state(ctx.rank, ctx.device),
    }


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer holds a parameter of shape {tuple(p.shape)} that is not a parameter of the model "
                    "given; build the optimizer over the parameters of the sharded model (the DMP shard() returned)"
                )
    return names


def _named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """A torch optimizer's tensor state keyed by parameter name (the live tensors: loading into
    them in place restores the optimizer)."""
    names = _param_names(model, optimizer)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            entries = {k: v for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
            if entries:
                out[names[id(p)]] = entries
    return out


def _init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, saved: set[str]) -> None:
    """Create the state a torch optimizer makes only at its first step (Adam's moments, SGD's
    momentum buffer) when the checkpoint has it, so that it can be loaded in place."""
    if optimizer is None:
        return
    if isinstance(optimizer, KeyedOptimizer):
        if hasattr(optimizer, "optimizers"):
            init_lazy_state(optimizer, getattr(model, "fused_optimizer", None))  # type: ignore[arg-type]
        return
    names = _param_names(model, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    lacking = [p for p in params if not optimizer.state.get(p)]
    if not any(any(k.startswith(f"optimizer.{names[id(p)]}.") for k in saved) for p in lacking):
        return
    # One step with zero gradients creates the state; the weights it may move (weight decay)
    # are loaded from the checkpoint next, and the state itself is overwritten.
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, g in zip(params, grads):
        p.grad = g
