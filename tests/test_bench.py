"""benchmarks/run.py's pieces: the hardware-limit arithmetic, the plain-PyTorch DLRM, the ``bench``
subcommand, its refusals and (slow) its MLPerf path through its command line, and one tiny growth
point on a spawned rank. The harness itself: tests/test_bench_harness.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from benchmarks import baselines, growth, hardware
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


def test_bench_subcommand_parses():
    from recsys_dist.cli.bench import cmd_bench
    from recsys_dist.cli.main import build_parser, command

    args = build_parser().parse_args(["bench", "--quick", "--skip", "3,5", "--model", "mlperf", "--batch", "64"])
    assert command(args.command) is cmd_bench and args.quick and args.skip == "3,5"
    assert args.model == "mlperf" and args.batch == 64 and args.copies is None
    for bad in (["--batch", "0"], ["--copies", "-1"], ["--reps", "x"]):
        with pytest.raises(SystemExit):  # argparse's error: a 0 must not read as "the default"
            build_parser().parse_args(["bench", *bad])


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


def test_bench_refuses_unknown_items_and_a_missing_gpu():
    for argv in (["--skip", "9"], ["--skip", "abc"]):
        done = bench("run.py", *argv)
        assert done.returncode == 2 and "--skip: comma-separated item numbers 1-6" in done.stderr, done.stderr
    if not torch.cuda.is_available():
        done = bench("run.py", "--device", "cuda")
        assert done.returncode == 2 and "--device cuda: torch" in done.stderr, done.stderr


@pytest.mark.slow
def test_one_tiny_growth_point():
    from recsys_dist.testing import run_ranks

    res = run_ranks(growth.sweep, 1, [100], [8], 100, 8, 0.05, timeout_s=240)[0]
    (point,) = res["rows"]
    assert point["samples_per_s"] > 0 and point["peak_rss_mb"] >= point["base_rss_mb"] > 0
    assert res["batch"][0]["batch"] == 8


def hook_vs_native(rank: int, world: int) -> float:
    """run_ranks target: 5 Adagrad steps of a sparse EmbeddingBag + Linear in DDP, averaged by
    gloo's sparse all-reduce and by ``sparse_allgather_hook``; max weight difference."""
    from torch import nn

    weights = []
    for hook in (False, True):
        torch.manual_seed(0)
        model = nn.ModuleDict({"e": nn.EmbeddingBag(50, 16, mode="sum", sparse=True), "l": nn.Linear(16, 1)})

        class Wrap(nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, ids):
                return self.m["l"](self.m["e"](ids)).squeeze(1)

        ddp = torch.nn.parallel.DistributedDataParallel(Wrap(model))
        if hook:
            ddp.register_comm_hook(None, baselines.sparse_allgather_hook)
        opt = torch.optim.Adagrad(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(5):
            opt.zero_grad()
            ddp(torch.randint(0, 50, (8, 1), generator=g)).pow(2).mean().backward()
            opt.step()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])


@pytest.mark.slow
def test_plain_baselines_sparse_hook_averages_as_ddp_does():
    from recsys_dist.testing import run_ranks

    assert run_ranks(hook_vs_native, 2, timeout_s=240) == [0.0, 0.0]


@pytest.mark.slow
def test_mlperf_path_runs_on_cpu():
    """The GPU benchmark's path (MLPerf DLRMv2 model, one rank, items 1, 4, 6) on CPU at toy
    sizes, through its command line: every line of its table is printed with a positive ratio."""
    args = ["--device", "cpu", "--model", "mlperf", "--mlperf-max-rows", "1000", "--batch", "256"]
    done = bench("run.py", *args, "--copies", "1", "--rows", "2000", "--reps", "1", "--skip", "5", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "dlrm_dcnv2" in out and "exact_adagrad fused" in out and "1 rank(s) on cpu" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "**" in line}
    assert set(rows) == {"1", "4", "6"}
    ratios = [float(line.split("**")[1]) for line in out.splitlines() if line.startswith("| ") and "**" in line]
    assert len(ratios) == 4 and all(r > 0 for r in ratios)


@pytest.mark.slow
def test_one_tiny_mlperf_growth_point():
    from recsys_dist.testing import run_ranks

    res = run_ranks(growth.sweep, 1, [100], [8], 100, 8, 0.05, True, "cpu", timeout_s=240)[0]
    (point,) = res["rows"]
    assert point["samples_per_s"] > 0 and point["table_mb"] == growth.TABLES * 100 * 129 * 4 / 2**20
