"""``recsys-dist bench``: benchmarks/run.py of the source checkout (ratios vs peers and the hardware limit)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def cmd_bench(args: argparse.Namespace) -> int:
    """Run benchmarks/run.py of the source checkout this package was imported from; its exit
    code, or 2 when the package was installed without the benchmarks."""
    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "run.py"
    if not script.is_file():
        print(
            f"recsys-dist bench: {script} not found; the benchmarks ship with the source checkout "
            "(git clone the repository and run it from there)",
            file=sys.stderr,
        )
        return 2
    cmd = [
        sys.executable,
        str(script),
        "--device",
        args.device,
        "--model",
        args.model,
    ] + (["--quick"] if args.quick else [])
    for flag in ("reps", "skip", "mlperf_max_rows", "batch", "copies", "deepctr_python"):
        if getattr(args, flag):
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    # The script imports this checkout's recsys_dist, whatever else is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, env=env).returncode
