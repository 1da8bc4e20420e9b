"""DIN and BST (with the derived user history) vs DeepFM (without it) on the shipped MovieLens
sample: 3 seeds each on the same split, then test AUC per seed, and for each sequence model a
paired bootstrap 95% interval of the mean (over seeds) AUC difference to DeepFM on the test rows,
and the wall time of each run. Results: benchmarks/results/sequence_patience_epoch_cpu2core_20261204.md
(time split, patience one epoch, best weights restored: the templates now); with a patience of 4
validations, sequence_time_split_cpu2core_20261202.md; before them, with a random split and 2 fixed
epochs, benchmarks/results/sequence_din_cpu2core_20261201.md and sequence_bst_cpu2core_20261201.md.

Run from the repository root:
python benchmarks/sequence_side_by_side.py OUT_DIR [--ranks N] [MODEL ...]
(MODEL among bst, din, deepfm; default all three). Trains 3 runs per model on 2 CPU ranks (the
configs' 2 x 64 rows a step; --ranks 1: 1 x 128, the same global batches), then predicts the
test split with each run's best checkpoint (checkpoint.keep_best; early stopping as configured).
DeepFM gets DIN's data, split, epochs, validation cadence, early stopping and keep_best, on the
same sorted file. A run whose summary.json exists is not trained again (its wall time is read
from wall_seconds.txt beside it), so an interrupted benchmark resumes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml
from sklearn.metrics import roc_auc_score

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.side_by_side import converted_test_split, paired_bootstrap, recsys_dist  # noqa: E402

SORTED = ROOT / "datasets/movielens/ratings_genres_first20000_by_time.csv"
DIN = ROOT / "configs/movielens_din.yaml"


def same_training_as_din() -> list[str]:
    """Overrides giving DeepFM DIN's rows, split and training schedule (the history aside)."""
    din = yaml.safe_load(DIN.read_text())
    keys = {
        "data.split": din["data"]["split"],
        "train.epochs": din["train"]["epochs"],
        "train.early_stopping": din["train"]["early_stopping"],
        "eval.every_n_steps": din["eval"]["every_n_steps"],
        "checkpoint.keep_best": din["checkpoint"]["keep_best"],
    }
    return [f"data.raw_path={SORTED}", *(f"{k}={json.dumps(v)}" for k, v in keys.items())]


RUNS = {  # name: (config, overrides)
    "bst": (ROOT / "configs/movielens_bst.yaml", []),
    "din": (DIN, []),
    "deepfm": (ROOT / "configs/movielens_deepfm.yaml", same_training_as_din()),
}
BASELINE = "deepfm"
SEEDS = (0, 1, 2)


def main(out: Path, kinds: list[str], ranks: int = 2) -> None:
    out = out.resolve()  # the commands run from the repository root
    # 1 rank x 128 rows trains on the same global batches as 2 x 64 (docs/data.md, Loading)
    world = [] if ranks == 2 else [f"distributed.nproc_per_node={ranks}", f"train.batch_size={128 // ranks}"]
    world += ["distributed.cpu_threads_per_rank=1"]  # shared cores: an OpenMP barrier waits on a descheduled thread
    preds, seconds = {}, {}
    for seed in SEEDS:
        for kind in kinds:
            config, overrides = RUNS[kind]
            overrides = [*overrides, *world]
            run = out / f"{kind}_s{seed}"
            if not (run / "summary.json").exists():
                _, wall = recsys_dist(
                    "train", "--config", config, "--run-dir", run, *overrides,
                    "train.progress_bar=false", f"train.seed={seed}",
                )  # fmt: skip
                (run / "wall_seconds.txt").write_text(f"{wall:.1f}\n")
            if (run / "wall_seconds.txt").exists():
                seconds[kind, seed] = float((run / "wall_seconds.txt").read_text())
            path = run / "test_preds.parquet"
            if not path.exists():
                test = converted_test_split(config, *overrides)
                recsys_dist("predict", "best", "--run-dir", run, "--data", test, "--out", path)
            best = json.loads((run / "summary.json").read_text())["best"]
            print(f"{kind} seed {seed}: best validation AUC {best['value']:.4f} at step {best['step']}")
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
        # Mean over seeds of AUC(kind) - AUC(baseline), and its 95% interval over bootstrap
        # resamples of the test rows (each resample scores both models of every seed on the same rows).
        base = [preds[BASELINE, s][1] for s in SEEDS]
        for kind in kinds:
            if kind != BASELINE:
                d, (lo, hi) = paired_bootstrap(y, [preds[kind, s][1] for s in SEEDS], base, roc_auc_score)
                print(f"{kind} - {BASELINE}: {d:+.4f}, 95% interval [{lo:+.4f}, {hi:+.4f}]")
    for kind in kinds:
        times = [seconds[kind, s] for s in SEEDS if (kind, s) in seconds]
        print(kind, "wall seconds per run (train + eval, incl. start-up):", [round(t, 1) for t in times])


if __name__ == "__main__":
    args = sys.argv[2:]
    n = 2
    if "--ranks" in args:
        i = args.index("--ranks")
        n = int(args[i + 1])
        del args[i : i + 2]
    main(Path(sys.argv[1]), args or list(RUNS), n)
