"""DIN and BST (with the derived user history) vs DeepFM (without it) on the shipped MovieLens
sample: 3 seeds each on the same split, then test AUC per seed, and for each sequence model a
paired bootstrap 95% interval of the mean (over seeds) AUC difference to DeepFM on the test rows,
and the wall time of each run. Results: benchmarks/results/sequence_din_cpu2core_20261201.md
(DIN), benchmarks/results/sequence_bst_cpu2core_20261201.md (BST, DIN and DeepFM).

Run from the repository root: python benchmarks/sequence_side_by_side.py OUT_DIR [MODEL ...]
(MODEL among bst, din, deepfm; default all three). Trains 3 runs of 2 CPU ranks per model,
then predicts each run's test split. A run whose summary.json exists is not trained again (its
wall time is read from wall_seconds.txt beside it), so an interrupted benchmark resumes.
Set RECSYS_DIST_CACHE to an empty directory: the test split is found there.
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
    "bst": ["--config", "configs/movielens_bst.yaml"],
    "din": ["--config", "configs/movielens_din.yaml"],
    "deepfm": ["--config", "configs/movielens_deepfm.yaml", f"data.raw_path={Path(SORTED).resolve()}"],
}
BASELINE = "deepfm"
SEEDS = (0, 1, 2)


def main(out: Path, kinds: list[str]) -> None:
    cli = [sys.executable, "-m", "recsys_dist.cli"]
    preds, seconds = {}, {}
    for seed in SEEDS:
        for kind in kinds:
            run = out / f"{kind}_s{seed}"
            if not (run / "summary.json").exists():
                t0 = time.perf_counter()
                subprocess.run(
                    [
                        *cli,
                        "train",
                        *RUNS[kind],
                        "--run-dir",
                        str(run),
                        "train.progress_bar=false",
                        f"train.seed={seed}",
                    ],
                    check=True,
                    capture_output=True,
                )
                (run / "wall_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
            if (run / "wall_seconds.txt").exists():
                seconds[kind, seed] = float((run / "wall_seconds.txt").read_text())
            test = _test_split(run)
            path = run / "test_preds.parquet"
            if not path.exists():
                subprocess.run([*cli, "predict", str(run), "--data", str(test), "--out", str(path)], check=True)
            t = pq.read_table(path).to_pydict()
            preds[kind, seed] = (np.array(t["label"]), np.array(t["probability"]))
    y = preds[kinds[0], 0][0]
    assert all(np.array_equal(lab, y) for lab, _ in preds.values()), "the models' test rows differ"
    print(f"test rows {len(y)}, positive {int(y.sum())}")
    auc = {k: roc_auc_score(y, p) for k, (_, p) in preds.items()}
    for kind in kinds:
        per_seed = [auc[kind, s] for s in SEEDS]
        print(kind, "test AUC", [round(a, 4) for a in per_seed], "mean", round(float(np.mean(per_seed)), 4))
    if BASELINE in kinds:
        rng = np.random.default_rng(0)
        rows = [rng.integers(0, len(y), len(y)) for _ in range(1000)]
        for kind in kinds:
            if kind != BASELINE:
                _paired(kind, y, preds, auc, rows)
    for kind in kinds:
        times = [seconds[kind, s] for s in SEEDS if (kind, s) in seconds]
        print(kind, "wall seconds per run (train + eval, incl. start-up):", [round(t, 1) for t in times])


def _paired(kind: str, y, preds, auc, rows) -> None:
    """Mean over seeds of AUC(kind) - AUC(baseline), and its 95% interval over bootstrap
    resamples of the test rows (each resample scores both models of every seed on the same rows)."""
    diffs = [
        np.mean(
            [roc_auc_score(y[i], preds[kind, s][1][i]) - roc_auc_score(y[i], preds[BASELINE, s][1][i]) for s in SEEDS]
        )
        for i in rows
    ]
    d = np.mean([auc[kind, s] - auc[BASELINE, s] for s in SEEDS])
    lo, hi = np.percentile(diffs, 2.5), np.percentile(diffs, 97.5)
    print(f"{kind} - {BASELINE}: {d:+.4f}, 95% interval [{lo:+.4f}, {hi:+.4f}]")


def _test_split(run: Path) -> Path:
    """The converted test split of the run's cache entry (the manifest beside it names it)."""
    cache = Path(os.environ.get("RECSYS_DIST_CACHE", Path.home() / ".cache/recsys_dist"))
    want = "history" if not run.name.startswith(BASELINE) else None
    for manifest in cache.glob("schema-*/manifest.json"):
        has_history = "history" in manifest.read_text()
        if (want is not None) == has_history:
            return manifest.parent / "test.parquet"
    raise FileNotFoundError(f"no converted test split for {run} under {cache}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(RUNS))
