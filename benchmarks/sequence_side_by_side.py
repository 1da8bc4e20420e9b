"""DIN (with the derived user history) vs DeepFM (without it) on the shipped MovieLens sample:
3 seeds each on the same split, then test AUC per seed and a paired bootstrap 95% interval
of the mean (over seeds) AUC difference on the test rows. Results:
benchmarks/results/sequence_din_cpu2core_20261201.md.

Run from the repository root: python benchmarks/sequence_side_by_side.py OUT_DIR
(trains 6 runs of 2 CPU ranks, then predicts each run's test split).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from sklearn.metrics import roc_auc_score

SORTED = "datasets/movielens/ratings_genres_first20000_by_time.csv"
RUNS = {
    "din": ["--config", "configs/movielens_din.yaml"],
    "deepfm": ["--config", "configs/movielens_deepfm.yaml", f"data.raw_path={Path(SORTED).resolve()}"],
}


def main(out: Path) -> None:
    cli = [sys.executable, "-m", "recsys_dist.cli"]
    preds, seconds = {}, {}
    for seed in (0, 1, 2):
        for kind, args in RUNS.items():
            run = out / f"{kind}_s{seed}"
            if not (run / "summary.json").exists():
                t0 = time.perf_counter()
                subprocess.run(
                    [*cli, "train", *args, "--run-dir", str(run), "train.progress_bar=false", f"train.seed={seed}"],
                    check=True,
                    capture_output=True,
                )
                seconds[kind, seed] = time.perf_counter() - t0
            test = _test_split(run)
            path = run / "test_preds.parquet"
            if not path.exists():
                subprocess.run([*cli, "predict", str(run), "--data", str(test), "--out", str(path)], check=True)
            t = pq.read_table(path).to_pydict()
            preds[kind, seed] = (np.array(t["label"]), np.array(t["probability"]))
    y = preds["din", 0][0]
    assert all(np.array_equal(lab, y) for lab, _ in preds.values()), "the two models' test rows differ"
    auc = {k: roc_auc_score(y, p) for k, (_, p) in preds.items()}
    for kind in RUNS:
        per_seed = [auc[kind, s] for s in (0, 1, 2)]
        print(kind, "test AUC", [round(a, 4) for a in per_seed], "mean", round(float(np.mean(per_seed)), 4))
    rng = np.random.default_rng(0)
    diffs = []
    for _ in range(1000):
        i = rng.integers(0, len(y), len(y))
        diffs.append(
            np.mean(
                [
                    roc_auc_score(y[i], preds["din", s][1][i]) - roc_auc_score(y[i], preds["deepfm", s][1][i])
                    for s in (0, 1, 2)
                ]
            )
        )
    d = np.mean([auc["din", s] - auc["deepfm", s] for s in (0, 1, 2)])
    print(f"DIN - DeepFM: {d:.4f}, 95% interval [{np.percentile(diffs, 2.5):.4f}, {np.percentile(diffs, 97.5):.4f}]")
    print("wall seconds per run:", {f"{k}_s{s}": round(v, 1) for (k, s), v in seconds.items()})


def _test_split(run: Path) -> Path:
    """The converted test split of the run's cache entry (the manifest beside it names it)."""
    cache = Path(os.environ.get("RECSYS_DIST_CACHE", Path.home() / ".cache/recsys_dist"))
    want = "history" if run.name.startswith("din") else None
    for manifest in cache.glob("schema-*/manifest.json"):
        has_history = "history" in manifest.read_text()
        if (want is not None) == has_history:
            return manifest.parent / "test.parquet"
    raise FileNotFoundError(f"no converted test split for {run} under {cache}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
