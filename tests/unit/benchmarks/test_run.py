"""benchmarks/run.py's pieces: the hardware-limit arithmetic, the plain-PyTorch DLRM, the ``bench``
subcommand, its refusals and (slow) its MLPerf path through its command line, and one tiny growth
point on a spawned rank. The harness itself: tests/unit/benchmarks/test_harness.py."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from benchmarks import baselines, hardware
from recsys_dist.config.loader import load_config
from tests.conftest import QUICKSTART, ROOT


def bench(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python benchmarks/SCRIPT ARGS`` from the repository root, as its docs run it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, f"benchmarks/{script}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def test_quickstart_bytes_and_flops_per_sample():
    cfg = load_config(QUICKSTART)
    # 26 one-hot tables, D = 16, row-wise Adagrad (1 state float per row):
    # per id 12 D + 8 bytes, per feature 8 D (pooled vector and its gradient).
    assert hardware.embedding_bytes_per_sample(cfg) == 26 * (12 * 16 + 8) + 26 * 8 * 16
    assert hardware.linear_shapes(cfg) == [(13, 64), (64, 16), (16 + 27 * 26 // 2, 64), (64, 32), (32, 1)]
    macs = 13 * 64 + 64 * 16 + 367 * 64 + 64 * 32 + 32
    assert hardware.flops_per_sample(cfg) == 3 * (2 * macs + 2 * 27 * 27 * 16)


def test_mlperf_state_and_cross_layers_count():
    cfg = load_config(
        QUICKSTART,
        [
            "model.name=dlrm_dcnv2",
            "train.embedding_optimizer=exact_adagrad",
            "model.dcn_num_layers=2",
            "model.dcn_low_rank_dim=8",
        ],
    )
    assert hardware.embedding_bytes_per_sample(cfg) == 26 * (12 * 16 + 8 * 16) + 26 * 8 * 16
    width = 27 * 16
    linear = sum(i * o for i, o in hardware.linear_shapes(cfg))
    assert hardware.linear_shapes(cfg)[2][0] == width
    assert hardware.flops_per_sample(cfg) == 3 * (2 * linear + 2 * (4 * width * 8 + 3 * width))


def test_measured_ceilings_are_positive():
    assert hardware.copy_bandwidth(torch.device("cpu"), mbytes=4, seconds=0.01) > 0
    assert hardware.mm_flops([(8, 4)], 16, torch.device("cpu"), seconds=0.01) > 0


def test_plain_dlrm_matches_torchrec_dlrm_shapes():
    model = baselines.PlainDLRM(13, [10] * 26, 16, [64, 16], [64, 32, 1])
    out = model(torch.rand(4, 13), torch.randint(0, 10, (4, 26)))
    assert out.shape == (4,)
    assert model.top[0].in_features == 16 + 27 * 26 // 2


def test_bench_subcommand_runs_this_checkouts_script_with_its_package(monkeypatch):
    """benchmarks/run.py no longer puts the checkout on sys.path itself: ``recsys-dist bench``
    passes it in PYTHONPATH, so the script runs the recsys_dist it was started from."""
    from recsys_dist.cli import bench as bench_cli
    from recsys_dist.cli.main import build_parser

    seen = {}

    def fake_run(cmd, env=None, **kw):
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_cli.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert bench_cli.cmd_bench(build_parser().parse_args(["bench", "--quick", "--reps", "2"])) == 0
    assert seen["cmd"][1] == str(ROOT / "benchmarks" / "run.py") and "--quick" in seen["cmd"]
    assert seen["env"]["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]
