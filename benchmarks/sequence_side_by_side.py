"""DIN, BST and HSTU (with the derived user history) vs DeepFM (without it) on the shipped MovieLens
sample: 3 seeds each on the same split, then test AUC per seed, and for each sequence model a
paired bootstrap 95% interval of the mean (over seeds) AUC difference to DeepFM on the test rows,
and the wall time of each run. Results: benchmarks/results/sequence_patience_epoch_cpu2core_20261204.md
(time split, patience one epoch, best weights restored: the templates now); with a patience of 4
validations, sequence_time_split_cpu2core_20261202.md; before them, with a random split and 2 fixed
epochs, benchmarks/results/sequence_din_cpu2core_20261201.md and sequence_bst_cpu2core_20261201.md.

Run from the repository root:
PYTHONPATH=$PWD .venv/bin/python benchmarks/sequence_side_by_side.py OUT_DIR [--ranks N] [MODEL ...]
(MODEL among bst, din, hstu, deepfm, hstu_items, hstu_time, hstu_both; default the first four; --baseline M
compares to M instead of DeepFM; HSTU's results:
benchmarks/results/hstu_movielens_cpu2core_20261205.md). Trains 3 runs per model on 2 CPU ranks (the
configs' 2 x 64 rows a step; --ranks 1: 1 x 128, the same global batches), then predicts the
test split with each run's best checkpoint (checkpoint.keep_best; early stopping as configured).
DeepFM gets DIN's data, split, epochs, validation cadence, early stopping and keep_best, on the
same sorted file. A run whose summary.json exists is not trained again (its wall time is read
from wall_seconds.txt beside it), so an interrupted benchmark resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

import harness

SORTED = harness.ROOT / "datasets/movielens/ratings_genres_first20000_by_time.csv"
DIN = harness.CONFIGS / "movielens_din.yaml"
HSTU = harness.CONFIGS / "movielens_hstu.yaml"
ITEMS_ONLY = ["data.schema.history.action=null", "model.action_tokens=false"]
TIME_BIAS = ["data.schema.history.times=true", "model.time_buckets=128"]


def same_training_as_din() -> list[str]:
    """Overrides giving DeepFM DIN's rows, split and training schedule (the history aside)."""
    import yaml

    din = yaml.safe_load(DIN.read_text())
    keys = {
        "data.split": din["data"]["split"],
        "train.epochs": din["train"]["epochs"],
        "train.early_stopping": din["train"]["early_stopping"],
        "eval.every_n_steps": din["eval"]["every_n_steps"],
        "checkpoint.keep_best": din["checkpoint"]["keep_best"],
    }
    return [f"data.raw_path={SORTED}", *(f"{k}={json.dumps(v)}" for k, v in keys.items())]


RUNS = {  # name: (config, overrides, or a function that makes them)
    "bst": (harness.CONFIGS / "movielens_bst.yaml", list),
    "din": (DIN, list),
    "hstu": (HSTU, list),
    "deepfm": (harness.CONFIGS / "movielens_deepfm.yaml", same_training_as_din),
    # HSTU variants (the shipped config has the rating actions; benchmarks/results/hstu_time_actions_*):
    # items only (the shipped config before 2026-12-05), with the time bias rab^t, with both
    "hstu_items": (HSTU, lambda: ITEMS_ONLY),
    "hstu_time": (HSTU, lambda: [*ITEMS_ONLY, *TIME_BIAS]),
    "hstu_both": (HSTU, lambda: TIME_BIAS),
}
BASELINE = "deepfm"
SEEDS = (0, 1, 2)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "sequence", "seed 0, 4 steps a run, validation every 2")
    p.add_argument("out", type=Path, help="run directories (a run with a summary.json is reused)")
    p.add_argument("models", nargs="*", metavar="MODEL", help=f"among {', '.join(RUNS)} (default: all)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per run (the global batch stays 128)")
    p.add_argument("--baseline", default=BASELINE, help=f"the model the others are compared to (default {BASELINE})")
    p.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds 0..N-1 per model (default 3)")
    args = p.parse_intermixed_args(argv)  # OUT_DIR --ranks N MODEL ...
    if unknown := [m for m in args.models if m not in RUNS]:
        p.error(f"unknown model(s) {unknown}; choose among {list(RUNS)}")
    with harness.Results(args, argv):
        run(
            args.out,
            args.models or ["bst", "din", "hstu", "deepfm"],
            args.ranks,
            (0,) if args.smoke else tuple(range(args.seeds)),
            args.smoke,
            args.baseline,
        )


def run(out: Path, kinds: list[str], ranks: int, seeds: tuple, smoke: bool, baseline: str = BASELINE) -> None:
    """Train and predict each model and seed (reusing what is there); print the comparison."""
    import numpy as np
    import pyarrow.parquet as pq
    from sklearn.metrics import roc_auc_score

    out = out.resolve()  # the commands run from the repository root
    # 1 rank x 128 rows trains on the same global batches as 2 x 64 (docs/data.md, Loading)
    world = [] if ranks == 2 else [f"distributed.nproc_per_node={ranks}", f"train.batch_size={128 // ranks}"]
    world += ["distributed.cpu_threads_per_rank=1"]  # shared cores: an OpenMP barrier waits on a descheduled thread
    world += [*harness.SMOKE_TRAIN, "eval.every_n_steps=2"] if smoke else []  # a validation: a best checkpoint
    preds, seconds = {}, {}
    for seed in seeds:
        for kind in kinds:
            config, make_overrides = RUNS[kind]
            overrides = [*make_overrides(), *world]
            rd = out / f"{kind}_s{seed}"
            if not (rd / "summary.json").exists():
                wall = harness.train(config, rd, *overrides, f"train.seed={seed}")["wall_s"]
                (rd / "wall_seconds.txt").write_text(f"{wall:.1f}\n")
            if (rd / "wall_seconds.txt").exists():
                seconds[kind, seed] = float((rd / "wall_seconds.txt").read_text())
            path = rd / "test_preds.parquet"
            if not path.exists():
                test = harness.converted_test_split(config, *overrides)
                harness.cli("predict", "best", "--run-dir", rd, "--data", test, "--out", path)
            best = harness.summary(rd)["best"]
            print(f"{kind} seed {seed}: best validation AUC {best['value']:.4f} at step {best['step']}")
            t = pq.read_table(path).to_pydict()
            preds[kind, seed] = (np.array(t["label"]), np.array(t["probability"]))
    y = preds[kinds[0], 0][0]
    assert all(np.array_equal(lab, y) for lab, _ in preds.values()), "the models' test rows differ"
    print(f"test rows {len(y)}, positive {int(y.sum())}")
    auc = {k: roc_auc_score(y, p) for k, (_, p) in preds.items()}
    for kind in kinds:
        per_seed = [auc[kind, s] for s in seeds]
        print(kind, "test AUC", [round(a, 4) for a in per_seed], "mean", round(float(np.mean(per_seed)), 4))
    if baseline in kinds:
        # Mean over seeds of AUC(kind) - AUC(baseline), and its 95% interval over bootstrap
        # resamples of the test rows (each resample scores both models of every seed on the same rows).
        base = [preds[baseline, s][1] for s in seeds]
        for kind in kinds:
            if kind != baseline:
                d, (lo, hi) = harness.paired_bootstrap(y, [preds[kind, s][1] for s in seeds], base, roc_auc_score)
                print(f"{kind} - {baseline}: {d:+.4f}, 95% interval [{lo:+.4f}, {hi:+.4f}]")
    for kind in kinds:
        times = [seconds[kind, s] for s in seeds if (kind, s) in seconds]
        print(kind, "wall seconds per run (train + eval, incl. start-up):", [round(t, 1) for t in times])


if __name__ == "__main__":
    main()
