"""``distributed.dense.strategy: pipeline``'s pieces without TorchRec (run via run_ranks): a tower
of four Linear layers cut into four stages on two ranks (loop placement), the other stages
freed on each rank; the scoring pass through the stages with a different row count per rank;
the whole state gathered to rank 0; the checkpoint's size estimate; a use of a freed weight."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from recsys_dist.checkpoint.dcp import global_bytes
from recsys_dist.checkpoint.gather import gather_full_state
from recsys_dist.distributed.stages import DenseStages, free_other_stages, run_stages


def score_gather_and_use(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)  # the same tower on every rank
    root = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3), nn.Linear(3, 1))
    whole = {k: v.clone() for k, v in root.state_dict().items()}
    x = torch.randn(3 + 2 * rank, 4, generator=torch.Generator().manual_seed(rank))  # 3 and 5 rows
    with torch.no_grad():
        want = root(x)
    stages = DenseStages(list(root), [0, 1, 2, 3], rank, dist.group.WORLD, per_rank=2)
    free_other_stages(root, stages)
    out = {"keys": sorted(root.state_dict()), "parameters": sum(p.numel() for p in root.parameters())}
    with torch.no_grad():
        out["score_diff"] = float((run_stages(stages, x) - want).abs().max())
    full = gather_full_state(root.state_dict())
    # the checkpoint's disk-space estimate counts every stage once (it counted rank 0's stages only)
    ctx = SimpleNamespace(is_main=rank == 0, world_size=world_size)
    out["estimate"] = global_bytes(ctx, {"model": root.state_dict()})
    out["whole_bytes"] = sum(v.numel() * v.element_size() for v in whole.values())
    if rank == 0:
        out["gathered"] = sorted(full) == sorted(whole) and all(torch.equal(full[k], whole[k]) for k in whole)
    try:
        root(x)
        out["use"] = "no error"
    except RuntimeError as err:
        out["use"] = str(err)
    return out
