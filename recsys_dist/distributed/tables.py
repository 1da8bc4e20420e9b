"""Moving weights between full (unsharded) tensors and a sharded model's state dict.

TorchRec's sharded state dicts hold ShardedTensor (or DTensor) values whose local shards
carry their offsets in the global tensor. These helpers load pretrained / reference
weights into every rank's shards and gather shards back into full tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed.shards_wrapper import LocalShardsWrapper


def _shards(t):
    """(local tensor, offsets) pairs of a ShardedTensor, or of the LocalShardsWrapper inside the
    DTensor of a replica-groups model (``sharding.replica_groups``, TorchRec's DMPCollection);
    None for a plain tensor."""
    if isinstance(t, ShardedTensor):
        return [(s.tensor, s.metadata.shard_offsets) for s in t.local_shards()]
    if isinstance(t, LocalShardsWrapper):
        return list(zip(t.local_shards(), t.local_offsets()))
    return None


@torch.no_grad()
def load_full_state_dict(sharded: dict, full: dict, strict: bool = True) -> None:
    """Copy full tensors into the matching local shards / replicas of a sharded state dict.

    Args:
        sharded: ``dmp.state_dict()`` (values alias the model's parameters).
        full: name -> full tensor with the global shape.
        strict: raise KeyError for a sharded key missing from ``full``.

    Raises:
        KeyError: a key is missing (strict). ValueError: a global shape differs.
    """
    for name, t in sharded.items():
        if name not in full:
            if strict:
                raise KeyError(f"{name}: not in the full state dict")
            continue
        src = full[name]
        size = tuple(t.size())  # a DTensor's is the global one
        if isinstance(t, DTensor):
            t = t.to_local()
        shards = _shards(t)
        if shards is None:
            if t.shape != src.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} given, model has {tuple(t.shape)}")
            t.copy_(src)
            continue
        if size != tuple(src.shape):
            raise ValueError(f"{name}: shape {tuple(src.shape)} given, model has {size}")
        for local, off in shards:
            index = tuple(slice(o, o + n) for o, n in zip(off, local.shape))
            local.copy_(src[index])


def full_tensor(t: DTensor) -> torch.Tensor:
    """The whole tensor of a DTensor, on every rank of its mesh. Collective over the mesh.

    A table of a replica-groups model (``sharding.replica_groups``, TorchRec's DMPCollection)
    holds a LocalShardsWrapper on a ("replicate", "shard") mesh, whose placements
    ``DTensor.full_tensor`` cannot assemble it from: table_wise ones read ``(Replicate(),
    Replicate())`` while only one rank of the group holds the table (the others' wrappers are
    empty), and over a group of one rank it returns the wrapper itself. Its shards are put in
    place here and summed over the sharding group (they never overlap; the replica groups
    each do the same). Any other DTensor: ``full_tensor()``."""
    local = t.to_local()
    if not isinstance(local, LocalShardsWrapper):
        return t.full_tensor()
    shards = _shards(local)
    out = torch.zeros(t.shape, dtype=t.dtype, device=shards[0][0].device if shards else "cpu")
    for piece, off in shards:
        out[tuple(slice(o, o + n) for o, n in zip(off, piece.shape))] = piece
    group = t.device_mesh.get_group("shard")
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


@torch.no_grad()
def gather_full_state_dict(sharded: dict) -> dict:
    """Every tensor of a sharded state dict as a full CPU tensor, on every rank."""
    out = {}
    for name, t in sharded.items():
        if isinstance(t, DTensor):
            out[name] = full_tensor(t).cpu()
        elif isinstance(t, ShardedTensor):
            full = torch.zeros(t.size(), dtype=t.dtype)
            for local, off in _shards(t):
                full[tuple(slice(o, o + n) for o, n in zip(off, local.shape))] = local.cpu()
            if dist.is_initialized() and dist.get_world_size() > 1:
                # Shards never overlap, so a sum assembles the full tensor everywhere.
                dist.all_reduce(full)
            out[name] = full
        elif isinstance(t, torch.Tensor):
            out[name] = t.detach().cpu().clone()
    return out


ROWS_PER_CHUNK = 1 << 16


def _chunk_generator(seed: int, table_index: int, chunk: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + table_index) * 1_000_033 + chunk) % (1 << 62))


def _fill_uniform(out: torch.Tensor, seed: int, table_index: int, r0: int, c0: int, dim: int, scale: float) -> None:
    """Fill ``out`` (rows ``r0...``, columns ``c0...`` of a table of width ``dim``) with the
    table's values there: row chunk ``c`` is drawn, uniform(-scale, scale) in float32, from a
    generator seeded by (seed, table_index, c), so the values never depend on the sharding.

    A chunk the shard holds whole (every column, float32 on CPU) is drawn straight into it;
    others through one chunk-sized buffer, so memory never holds a second copy of the shard."""
    rows, cols = out.shape
    first, last = r0 // ROWS_PER_CHUNK, (r0 + rows - 1) // ROWS_PER_CHUNK
    whole_width = c0 == 0 and cols == dim and out.dtype == torch.float32 and out.device.type == "cpu"
    for c in range(first, last + 1):
        lo = max(r0 - c * ROWS_PER_CHUNK, 0)
        hi = min(r0 + rows - c * ROWS_PER_CHUNK, ROWS_PER_CHUNK)
        dst = out[c * ROWS_PER_CHUNK + lo - r0 : c * ROWS_PER_CHUNK + hi - r0]
        g = _chunk_generator(seed, table_index, c)
        if whole_width and lo == 0 and hi == ROWS_PER_CHUNK and dst.is_contiguous():
            dst.uniform_(-scale, scale, generator=g)  # the same draws, in the same order, as a fresh chunk
        else:
            chunk = torch.empty(ROWS_PER_CHUNK, dim).uniform_(-scale, scale, generator=g)
            dst.copy_(chunk[lo:hi, c0 : c0 + cols])


@torch.no_grad()
def init_tables(sharded: dict, tables: list, seed: int, scales: dict[str, float]) -> None:
    """Initialise every table uniform(-scale, scale) independently of how it is sharded.

    TorchRec initialises each shard with its own random draws, so the same seed gives
    different weights on 1 and on 2 ranks. This makes the initial weights a function of
    (seed, table, row) only, so runs at different world sizes start from the same model.

    Args:
        sharded: ``dmp.state_dict()``.
        tables: the EmbeddingBagConfigs / EmbeddingConfigs, in model order (their index is part of the seed).
        scales: table name -> scale.
    """
    for index, t in enumerate(tables):
        ends = (f"embedding_bags.{t.name}.weight", f"embeddings.{t.name}.weight")  # EBC / EC tables
        key = next((k for k in sharded if k.endswith(ends)), None)
        if key is None:
            continue
        value = sharded[key]
        if isinstance(value, DTensor):
            value = value.to_local()
        shards = _shards(value)
        if shards is None:  # replicated (data-parallel) table: the whole tensor
            shards = [(value, (0, 0))]
        for local, (r0, c0) in shards:
            rows, cols = local.shape
            if rows == 0:
                continue
            _fill_uniform(local, seed, index, r0, c0, t.embedding_dim, scales[t.name])
