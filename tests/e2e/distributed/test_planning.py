"""Dry-run planning: no process group, no GPU, any world size."""

import json

import pytest

from tests.cli import run_cli
from tests.conftest import ROOT
from tests.unit.distributed.test_planning import MLPERF


def test_plan_cli_64_gpus_json_and_failure_exit_code():
    cmd = ["plan", "--config", str(MLPERF)]
    r = run_cli(cmd + ["--world-size", "64", "--local-world-size", "8", "--hbm-gb", "80", "--json"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert len(out["hbm_gb"]) == 64 and len(out["placements"]) == 26
    r = run_cli(cmd + ["--world-size", "1", "--hbm-gb", "80"], timeout=300)
    assert r.returncode == 1 and "no sharding plan fits" in r.stderr


DLRMV2 = ROOT / "configs" / "criteo_dlrmv2.yaml"
DENSE_BYTES = 16_044_545 * 4  # MLPerf DLRMv2's dense tower (bottom, 3 low-rank cross layers, over-arch), fp32


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("ddp", marks=pytest.mark.slow),
        "fsdp",
        pytest.param("pipeline", marks=pytest.mark.slow),
    ],
)
def test_criteo_dlrmv2_plans_8_and_64_gpus_under_each_dense_layout(strategy):
    """The shipped config that trains on 2 CPU ranks plans a 64-GPU run: every table placed, the
    dense tower's bytes per rank as each layout holds them (Adagrad: state = parameters)."""
    extra = ["distributed.dense.stages=2"] if strategy == "pipeline" else []
    for world in (8, 64):
        cmd = ["plan", "--config", DLRMV2, "--world-size", world, "--local-world-size", 8, "--json"]
        r = run_cli([*cmd, f"distributed.dense.strategy={strategy}", *extra], timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout)
        assert len(out["hbm_gb"]) == world and len(out["placements"]) == 26
        dense = out["dense"]
        assert dense["strategy"] == strategy and dense["optimizer"] == "adagrad" and len(dense["per_rank"]) == world
        params = [d["parameters"] for d in dense["per_rank"]]
        assert all(d["optimizer"] == d["parameters"] for d in dense["per_rank"])
        grads = [d["gradients"] for d in dense["per_rank"]]
        assert grads == params  # every layout: a rank's gradients are those of the parameters it holds
        if strategy == "pipeline":  # a rank's own stage; a pipeline's 2 ranks hold the tower between them
            assert all(0 < p < DENSE_BYTES for p in params) and params[0] + params[1] == DENSE_BYTES
            assert params == params[:2] * (world // 2)  # the same stage in every pipeline
        elif strategy == "fsdp":  # cut on dim 0 of each weight: ~1/world each, summing to the tower
            assert sum(params) == DENSE_BYTES and max(params) <= DENSE_BYTES / world * 1.01, params[:3]
        else:  # ddp: the whole tower on every rank
            assert params == [DENSE_BYTES] * world
