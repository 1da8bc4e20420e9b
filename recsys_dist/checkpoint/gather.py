"""The unsharded model state in memory: what a checkpoint of the model would load as, gathered
from the training ranks without writing or reading files (publishing after a partition,
``recsys_dist.serve.publish_callback``).

Why not what torch / TorchRec already have (all of which work on CPU/gloo): ``ShardedTensor.gather``
is one ``dist.gather`` per table (a model with hundreds of tables pays hundreds of collectives
per publish); ``recsys_dist.distributed.tables.gather_full_state_dict`` all-reduces every
full table on every rank (world size x the model in memory, and a sum, not a copy, of the
values); ``torch.distributed.checkpoint`` round-trips through files. Here the shards of many
tables travel in one ``dist.gather`` per dtype and ``CHUNK_BYTES``, and only ``dst`` holds
the full state. A DTensor uses its own ``full_tensor()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from recsys_dist.distributed.tables import full_tensor

CHUNK_BYTES = 256 * 2**20  # per rank and collective: bounds the gather buffers held at once


def gather_full_state(state: Mapping[str, Any], dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Every tensor of a (sharded) model state dict, whole, on rank ``dst``. Collective: every
    rank calls it with its own ``model.state_dict()`` (the same sharded keys, in the same order).
    A plain tensor that only some ranks hold (``distributed.dense.strategy: pipeline``: a rank
    holds its own stages' weights) comes to ``dst`` from the lowest rank that holds it.

    ShardedTensors (sharded embedding tables) are gathered from the ranks holding their shards,
    several tables per collective (one ``dist.gather`` per dtype and ``CHUNK_BYTES`` of shards
    per rank, not one per table); a DTensor is assembled; a plain tensor (dense weights, which
    data parallelism keeps equal on every rank, and replicated buffers) is ``dst``'s own. The
    values are those a checkpoint of this state holds, bit for bit (same dtype and shape).
    Memory on ``dst``: the full state plus up to world size x ``CHUNK_BYTES`` of buffers.

    Returns:
        On ``dst``: key -> a CPU tensor of the full shape (a copy: training on does not change it).
        On every other rank: None.

    Raises:
        TypeError: a value that is not a tensor. ValueError: a ShardedTensor over a subgroup.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, torch.Tensor] = {}
    sharded: list[tuple[str, ShardedTensor]] = []
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            if dist.is_initialized() and dist.get_world_size(value._process_group) != dist.get_world_size():
                raise ValueError(f"gather_full_state: {key} is sharded over a subgroup of the ranks; not supported")
            sharded.append((key, value))
        elif isinstance(value, DTensor):
            full = full_tensor(value).detach().cpu().clone()
            if rank == dst:
                out[key] = full
        elif isinstance(value, torch.Tensor):
            if rank == dst:
                out[key] = value.detach().cpu().clone()
        else:
            raise TypeError(f"gather_full_state: {key} is a {type(value).__name__}, not a tensor")
    for chunk in _chunks(sharded):
        full = _gather_sharded(chunk, rank, dst)
        if full is not None:
            out.update(full)
    extra = _held_elsewhere(state, rank, dst)
    return {**{k: out[k] for k in state}, **extra} if rank == dst else None


def _held_elsewhere(state: Mapping[str, Any], rank: int, dst: int) -> dict[str, torch.Tensor]:
    """The plain tensors ``dst`` does not hold, from the lowest rank holding each (one
    ``all_gather_object`` of the ranks' plain keys, then a send / recv per tensor ``dst`` lacks);
    on ``dst`` key -> a CPU copy, elsewhere ``{}``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    plain = {
        k: (tuple(v.shape), v.dtype)
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not isinstance(v, (ShardedTensor, DTensor))
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, plain)
    out: dict[str, torch.Tensor] = {}
    device = next((state[k].device for k in plain), torch.device("cpu"))  # what the backend sends on
    for src, held in enumerate(every):
        for key, (shape, dtype) in held.items():
            if key in every[dst] or any(key in every[r] for r in range(src)):
                continue  # dst holds it, or a lower rank sends it
            if rank == src:
                dist.send(state[key].detach().contiguous(), dst=dst)
            elif rank == dst:
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(t, src=src)
                out[key] = t.cpu()
    return out


def _chunks(sharded: list[tuple[str, ShardedTensor]]) -> list[list[tuple[str, ShardedTensor]]]:
    """``sharded`` split by dtype, then into runs of at most ``CHUNK_BYTES`` of shards on any rank
    (a larger tensor alone); the same split on every rank (from the global shard metadata)."""
    by_dtype: dict[torch.dtype, list[tuple[str, ShardedTensor]]] = {}
    for key, value in sharded:
        by_dtype.setdefault(value.metadata().tensor_properties.dtype, []).append((key, value))
    chunks = []
    for items in by_dtype.values():
        current: list = []
        per_rank: dict[int, int] = {}
        for key, value in items:
            size = value.metadata().tensor_properties.dtype.itemsize
            adds = {}
            for md in value.metadata().shards_metadata:
                r = md.placement.rank()
                adds[r] = adds.get(r, 0) + _numel(md.shard_sizes) * size
            if current and any(per_rank.get(r, 0) + b > CHUNK_BYTES for r, b in adds.items()):
                chunks.append(current)
                current, per_rank = [], {}
            current.append((key, value))
            for r, b in adds.items():
                per_rank[r] = per_rank.get(r, 0) + b
        if current:
            chunks.append(current)
    return chunks


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _gather_sharded(chunk: list[tuple[str, ShardedTensor]], rank: int, dst: int) -> dict | None:
    """One ``dist.gather`` of every rank's shards of ``chunk`` (one dtype) into ``dst``; there,
    key -> the full CPU tensor."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtype = chunk[0][1].metadata().tensor_properties.dtype
    device = chunk[0][1]._get_preferred_device()  # the shards' device: what the backend gathers on
    layout: list[list[tuple[str, Any]]] = [[] for _ in range(world)]  # per rank: its shards, in order
    for key, value in chunk:
        for md in value.metadata().shards_metadata:
            layout[md.placement.rank()].append((key, md))
    sizes = [sum(_numel(md.shard_sizes) for _, md in shards) for shards in layout]
    local = {(key, tuple(s.metadata.shard_offsets)): s.tensor for key, value in chunk for s in value.local_shards()}
    data = torch.empty(max(sizes), dtype=dtype, device=device)
    offset = 0
    for key, md in layout[rank]:
        n = _numel(md.shard_sizes)
        data[offset : offset + n].copy_(local[(key, tuple(md.shard_offsets))].flatten())
        offset += n
    buffers = [torch.empty_like(data) for _ in range(world)] if rank == dst else None
    if world > 1:
        dist.gather(data, gather_list=buffers, dst=dst)
    elif buffers is not None:
        buffers[0] = data
    if rank != dst:
        return None
    full = {key: torch.empty(value.size(), dtype=dtype) for key, value in chunk}
    for r, shards in enumerate(layout):
        flat, offset = buffers[r].cpu(), 0
        for key, md in shards:
            n = _numel(md.shard_sizes)
            region = full[key]
            for dim, (start, length) in enumerate(zip(md.shard_offsets, md.shard_sizes)):
                region = region.narrow(dim, start, length)
            region.copy_(flat[offset : offset + n].view(md.shard_sizes))
            offset += n
    return full
