"""What the side-by-side benchmarks share: run ``recsys-dist`` in a fresh process, find a
config's converted test split, read a run's managed remapping time, and the paired bootstrap
interval of a metric difference over test rows.

Used by managed_quality.py, managed_speed.py, multitask_side_by_side.py, qcomms.py,
reshard_matrix.py and sequence_side_by_side.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def recsys_dist(*args, code: Path = ROOT) -> tuple[str, float]:
    """``recsys-dist ARGS`` in a fresh process, importing and running from the checkout
    ``code`` (default this one). Returns (stdout, wall seconds); raises RuntimeError with the
    end of stderr on a non-zero exit."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "recsys_dist.cli.main", *map(str, args)],
        cwd=code,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(code)},
    )
    if r.returncode:
        raise RuntimeError(f"recsys-dist {' '.join(map(str, args))} -> exit {r.returncode}\n{r.stderr[-3000:]}")
    return r.stdout, time.perf_counter() - t0


def converted_test_split(config, *overrides) -> Path:
    """The converted test split of CONFIG (with OVERRIDES), as ``recsys-dist preprocess``
    names it: the conversion cache entry its manifest sits in."""
    out, _ = recsys_dist("preprocess", "--config", config, "--quiet", *overrides)
    manifest = next(line.split("manifest:")[1].strip() for line in out.splitlines() if "manifest:" in line)
    return Path(manifest).parent / "test.parquet"


def remap_ms_per_step(run_dir: Path) -> float | None:
    """The mean of ``managed_remap_ms_per_step`` over a run's metrics.jsonl (None: no managed tables)."""
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    remap = [m["managed_remap_ms_per_step"] for m in lines if "managed_remap_ms_per_step" in m]
    return round(sum(remap) / len(remap), 2) if remap else None


def paired_bootstrap(
    labels: np.ndarray,
    a: Sequence[np.ndarray],
    b: Sequence[np.ndarray],
    metric: Callable[[np.ndarray, np.ndarray], float],
    n: int = 1000,
    seed: int = 0,
) -> tuple[float, list[float]]:
    """The mean over seeds of metric(a) - metric(b) on the test rows, and its 95% interval.

    ``a[s]`` and ``b[s]`` are the two variants' scores of seed s for the same rows, in the
    order of ``labels``. Each of ``n`` bootstrap replicates draws one resample of the rows
    (with replacement) and scores every seed of both variants on it; replicates with a single
    label value are skipped (AUC is undefined there). Returns (point difference, [2.5th,
    97.5th percentile of the replicates])."""
    labels = np.asarray(labels)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} runs of one variant vs {len(b)} of the other")
    point = float(np.mean([metric(labels, x) - metric(labels, y) for x, y in zip(a, b)]))
    rng = np.random.default_rng(seed)
    rows = len(labels)
    diffs = []
    for _ in range(n):
        i = rng.integers(0, rows, rows)
        if labels[i].min() == labels[i].max():
            continue
        diffs.append(float(np.mean([metric(labels[i], x[i]) - metric(labels[i], y[i]) for x, y in zip(a, b)])))
    return point, [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))]
