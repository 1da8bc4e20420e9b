"""benchmarks/run.py's pieces: the hardware-limit arithmetic, the plain-PyTorch DLRM, the ``bench``
subcommand, its refusals and (slow) its MLPerf path through its command line, and one tiny growth
point on a spawned rank. The harness itself: tests/unit/benchmarks/test_harness.py."""

from __future__ import annotations

import pytest
import torch

from tests.unit.benchmarks.test_run import bench


def test_bench_subcommand_parses():
    from recsys_dist.cli.bench import cmd_bench
    from recsys_dist.cli.main import build_parser, command

    args = build_parser().parse_args(["bench", "--quick", "--skip", "3,5", "--model", "mlperf", "--batch", "64"])
    assert command(args.command) is cmd_bench and args.quick and args.skip == "3,5"
    assert args.model == "mlperf" and args.batch == 64 and args.copies is None
    for bad in (["--batch", "0"], ["--copies", "-1"], ["--reps", "x"]):
        with pytest.raises(SystemExit):  # argparse's error: a 0 must not read as "the default"
            build_parser().parse_args(["bench", *bad])


def test_bench_refuses_unknown_items_and_a_missing_gpu():
    for argv in (["--skip", "9"], ["--skip", "abc"]):
        done = bench("run.py", *argv)
        assert done.returncode == 2 and "--skip: comma-separated item numbers 1-6" in done.stderr, done.stderr
    if not torch.cuda.is_available():
        done = bench("run.py", "--device", "cuda")
        assert done.returncode == 2 and "--device cuda: torch" in done.stderr, done.stderr


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
