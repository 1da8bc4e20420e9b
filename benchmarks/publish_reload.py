"""Reload time of a publish directory: incremental (only the new deltas, ``apply_versions``, what
``recsys-dist serve`` does on a reload) vs the full fold (``load_published``: the full version and
every delta), for a chain of ``--deltas`` deltas of the quickstart DLRM (26 tables x 10,000 rows x 16).

Trains the quickstart on 1 rank for ``deltas + 1`` steps with ``publish.every_n_steps: 1`` (one
version per step: a full version, then a delta per step of ~26 x 32 changed rows per table set,
and the dense weights), reusing a run already under ``--work``. Then times (median of
``--repeat``), on version k = 1 + deltas:

- full fold of version k (a fresh server start, and every reload before incremental reload);
- incremental reload from k-1 to k (one new delta) and from 1 to k (all deltas at once);
- full fold of version 1 + N for N = ``--full-every`` (a fresh start under ``publish.full_every: N``).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/publish_reload.py [--deltas 50] [--work DIR]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from recsys_dist.serve.publish import apply_versions, latest_version, load_published  # noqa: E402


def train(run: Path, steps: int) -> None:
    if latest_version(run / "publish") == steps:
        return
    cmd = [
        sys.executable,
        "-m",
        "recsys_dist.cli.main",
        "train",
        "--config",
        str(ROOT / "configs/criteo_quickstart.yaml"),
    ]
    cmd += [
        "--run-dir",
        str(run),
        "distributed.nproc_per_node=1",
        "train.progress_bar=false",
        f"train.max_steps={steps}",
    ]
    cmd += ["checkpoint.every_n_steps=1", "checkpoint.keep=2", "publish.enabled=true", "publish.every_n_steps=1"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deltas", type=int, default=50)
    ap.add_argument("--full-every", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/publish_reload"))
    args = ap.parse_args()
    run = args.work / "run"
    k = args.deltas + 1
    train(run, k)
    pub = run / "publish"
    first, _ = load_published(pub, 1)
    before, _ = load_published(pub, k - 1)
    rows = {
        f"full fold of v{k} (full + {args.deltas} deltas)": timed(lambda: load_published(pub, k), args.repeat),
        f"full fold of v{1 + args.full_every} (full + {args.full_every} deltas: full_every {args.full_every})": timed(
            lambda: load_published(pub, 1 + args.full_every), args.repeat
        ),
        "full fold of v1 (the full version alone)": timed(lambda: load_published(pub, 1), args.repeat),
        f"incremental v{k - 1} -> v{k} (1 delta)": timed(lambda: apply_versions(before, pub, k - 1, k), args.repeat),
        f"incremental v1 -> v{k} ({args.deltas} deltas)": timed(lambda: apply_versions(first, pub, 1, k), args.repeat),
    }
    print(f"# publish reload, quickstart DLRM, {platform.machine()} {platform.processor() or ''}".rstrip())
    print(f"median of {args.repeat}; {pub}\n\n| what | seconds |\n| --- | --- |")
    for what, s in rows.items():
        print(f"| {what} | {s:.3f} |")


if __name__ == "__main__":
    main()
