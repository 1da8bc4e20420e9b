"""``recsys_dist.checkpoint.gather.gather_full_state`` on 2 ranks: row-wise, column-wise and
table-wise shards (uneven, one rank holding none of a table), two dtypes and a plain tensor come
back whole on rank 0, bit for bit, in one collective per dtype or in chunks of a few bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

from recsys_dist.checkpoint import gather
from recsys_dist.testing import run_ranks

# name -> (full shape, dtype, [(rank, offsets, sizes)])
LAYOUT = {
    "rows": ((10, 4), torch.float32, [(0, (0, 0), (6, 4)), (1, (6, 0), (4, 4))]),
    "columns": ((6, 8), torch.float32, [(0, (0, 0), (6, 3)), (1, (0, 3), (6, 5))]),
    "rank1_only": ((5, 3), torch.float32, [(1, (0, 0), (5, 3))]),
    "half": ((4, 2), torch.float16, [(0, (0, 0), (4, 2))]),
}


def full(name: str) -> torch.Tensor:
    shape, dtype, _ = LAYOUT[name]
    n = shape[0] * shape[1]
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.37 - 3.1 + len(name)).to(dtype)


def state_of(rank: int) -> dict:
    state = {"dense": torch.full((3,), 2.5)}
    for name, (shape, _, shards) in LAYOUT.items():
        mine = []
        for r, offsets, sizes in shards:
            if r == rank:
                region = full(name)[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
                mine.append(Shard.from_tensor_and_offsets(region.clone(), list(offsets), rank))
        state[name] = init_from_local_shards(mine, *shape)
    return state


def gather_twice(rank: int, world_size: int) -> list:
    out = [gather.gather_full_state(state_of(rank))]
    gather.CHUNK_BYTES = 16  # a chunk per tensor: the same values
    out.append(gather.gather_full_state(state_of(rank)))
    dist.barrier()
    return out


@pytest.mark.slow
def test_sharded_tensors_come_back_whole_on_rank_0():
    (got0, got1), (none0, none1) = run_ranks(gather_twice, 2)
    assert none0 is None and none1 is None
    for got in (got0, got1):
        assert list(got) == ["dense", *LAYOUT]
        assert torch.equal(got["dense"], torch.full((3,), 2.5))
        for name in LAYOUT:
            assert got[name].dtype == LAYOUT[name][1] and torch.equal(got[name], full(name)), name
