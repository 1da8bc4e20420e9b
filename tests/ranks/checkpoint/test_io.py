"""Checkpoint writes that fail (disk full, read-only directory) and tampered checkpoint files,
on one process: clear errors, the previous checkpoint intact, nothing unpickled."""

import json

import pytest
import torch

from recsys_dist.checkpoint import dcp as ck
from recsys_dist.checkpoint import integrity
from recsys_dist.distributed.env import DistContext
from tests.unit.checkpoint import test_io as unit_test_io
from tests.unit.checkpoint.test_io import (
    _zeros_inside,
)

run = unit_test_io.run  # the fixture, shared with tests.unit.checkpoint.test_io


def _two_rank_damage(rank, world_size, run):
    import torch.distributed as dist

    from recsys_dist.checkpoint import run_dir as run_dirs
    from recsys_dist.distributed.env import broadcast_result

    ctx = DistContext(rank, world_size, rank, world_size, torch.device("cpu"), "gloo")

    def state(value):  # one entry per rank, so that each rank writes a shard file of its own
        return {
            "model": {"w": torch.full((64, 4), value)},
            "own": {f"rank_{rank}": torch.full((128, 256), value + rank)},
        }

    for step in (4, 8):
        ck.save_checkpoint(ctx, run, step, state(float(step)), {"step": step}, keep=3)
    new = run / "checkpoints" / "step_00000008"
    listed = sorted(json.loads((new / integrity.CHECKSUMS_FILE).read_text())["files"])
    dist.barrier()
    if rank == 1:  # the shard rank 1 wrote, checksummed by rank 1
        _zeros_inside(new / "__1_0.distcp", at=1024)
    dist.barrier()
    out = {"listed": listed}
    try:  # every rank takes rank 0's verdict: all raise, none waits in a collective
        ck.load_checkpoint(new, state(0.0))
    except ck.CheckpointDamaged as err:
        out["error"] = str(err)
    out["auto"] = broadcast_result(ctx, lambda: run_dirs.resolve_resume("auto", run, warn=lambda text: None))
    loaded = state(0.0)
    ck.load_checkpoint(out["auto"], loaded)
    out["own"] = float(loaded["own"][f"rank_{rank}"][0, 0])
    return out


@pytest.mark.slow  # 2 ranks
def test_damage_on_one_rank_is_seen_by_every_rank(tmp_path):
    from recsys_dist.testing import run_ranks

    results = run_ranks(_two_rank_damage, 2, tmp_path, timeout_s=120)
    shard = tmp_path / "checkpoints" / "step_00000008" / "__1_0.distcp"
    for rank, got in enumerate(results):
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json"} <= set(got["listed"])
        assert f"{shard}: its CRC-32 differs" in got["error"], got
        assert got["auto"] == tmp_path / "checkpoints" / "step_00000004"
        assert got["own"] == 4.0 + rank
