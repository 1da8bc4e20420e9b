"""Putting back the best validation weights when training ends (``train.early_stopping.restore_best``).

With checkpoints on, every new best is saved as a checkpoint (``checkpoints/best``, which
``checkpoint.keep`` never deletes) and read back from it with DCP at the end: each rank loads
its own shards of the embedding tables, the dense weights and the optimizer state, whatever
the plan. What the run then scores and saves last is exactly what that checkpoint holds, and a
run resumed after a kill reads the best weights its first part found. With checkpoints off
(no resume possible), each rank keeps a copy of its part of the model state in memory instead.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_dist.checkpoint.meta import is_complete, read_meta


def checkpoint_of_step(roots: list[Path], step: int) -> Path | None:
    """The first complete checkpoint ``ROOT/step_N`` of ``step`` under ``roots`` (checkpoint
    directories, e.g. the run's ``checkpoints/`` and that of the checkpoint a run resumed from)
    whose ``meta.json`` says it is that step's; None when there is none (deleted by hand, or
    never written)."""
    for root in roots:
        path = Path(root) / f"step_{step:08d}"
        try:
            if is_complete(path) and read_meta(path).get("step") == step:
                return path
        except Exception:  # noqa: BLE001 - unreadable: not one to restore from (the caller warns if none is)
            continue
    return None


def _local_tensors(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """This rank's tensors of every entry of ``model.state_dict()``: the local shards of a
    sharded table, the tensor itself otherwise. They are views of the live weights."""
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            out[key] = [shard.tensor for shard in value.local_shards()]
        elif hasattr(value, "to_local"):  # a DTensor
            out[key] = [value.to_local()]
        elif isinstance(value, torch.Tensor):
            out[key] = [value]
    return out


class MemoryCopy:
    """A copy, in this rank's memory, of its part of the model's weights at the best step
    (checkpoints off). Costs one more copy of the rank's shards and dense weights.

    Attributes:
        step: the step of the weights held (None before :meth:`keep`).
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self._saved: dict[str, list[torch.Tensor]] = {}

    @torch.no_grad()
    def keep(self, model: nn.Module, step: int) -> None:
        """Copy the model's current weights (those of ``step``)."""
        self._saved = {k: [t.detach().clone() for t in ts] for k, ts in _local_tensors(model).items()}
        self.step = step

    @torch.no_grad()
    def restore(self, model: nn.Module) -> None:
        """Write the kept weights back into ``model`` in place.

        Raises:
            RuntimeError: nothing was kept, or the model's tensors are not the ones copied.
        """
        if self.step is None:
            raise RuntimeError("MemoryCopy.restore: no weights were kept")
        live = _local_tensors(model)
        if live.keys() != self._saved.keys():
            raise RuntimeError("MemoryCopy.restore: the model's state entries changed since they were kept")
        for key, tensors in live.items():
            for target, saved in zip(tensors, self._saved[key], strict=True):
                target.copy_(saved)
