"""Managed-collision tables vs hash-mod vs the full vocabulary, at 1/8 of the distinct ids.

MovieLens (configs/movielens_{managed,hashmod,deepfm}.yaml) and Avazu
(configs/avazu_{managed,hashmod,vocabulary}.yaml): DeepFM, test AUC per seed, and a paired
bootstrap over test rows (the three variants score the same rows in the same order; each
replicate draws one row sample, takes the AUC difference per seed and averages over seeds)
for managed minus hash-mod and managed minus vocabulary. Also samples/s of each run and the
managed tables' test default-row share (ids without a row). Runs on 1 rank with the configs'
global batch (equal to their 2-rank runs within 1e-5, README), to spare a shared machine.

    .venv/bin/python benchmarks/managed_quality.py [--seeds 0 1 2] [--boot 1000] [--data movielens avazu]
        [--variants managed hashmod vocabulary] [--out DIR] [--train-only]

With ``--out DIR`` runs and predictions stay in DIR and are reused by a later call, so the
variants can train in separate processes (``--train-only``) and be compared at the end.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import harness

VARIANTS = {
    "movielens": {
        "managed": "movielens_managed.yaml",
        "hashmod": "movielens_hashmod.yaml",
        "vocabulary": "movielens_deepfm.yaml",
    },
    "avazu": {"managed": "avazu_managed.yaml", "hashmod": "avazu_hashmod.yaml", "vocabulary": "avazu_vocabulary.yaml"},
}
GLOBAL_BATCH = {"movielens": 128, "avazu": 64}


def _row(rd: Path, seed: int) -> dict:
    summary = harness.summary(rd)
    test_line = next(m for m in harness.metrics(rd) if m["split"] == "test")
    return {
        "seed": seed,
        "test_auc": test_line["auc"],
        "samples_per_s": summary.get("samples_per_s"),
        "remap_ms_per_step": harness.mean_metric(rd, "managed_remap_ms_per_step"),
        "default_share": {f: v["default_share"] for f, v in test_line.get("managed", {}).items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "managed_quality", "MovieLens, managed and hash-mod, seed 0, 4 steps, 20 replicates")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--boot", type=int, default=1000)
    p.add_argument("--data", nargs="+", default=list(VARIANTS))
    p.add_argument("--variants", nargs="+", default=["managed", "hashmod", "vocabulary"])
    p.add_argument("--out", help="keep runs and predictions here; runs already there are reused")
    p.add_argument("--train-only", action="store_true", help="train and predict, no comparison")
    args = p.parse_args(argv)
    extra = []
    if args.smoke:
        args.seeds, args.boot, args.data, args.variants = [0], 20, ["movielens"], ["managed", "hashmod"]
        extra = harness.SMOKE_TRAIN
    with harness.Results(args, argv):
        run(args, extra)


def run(args, extra: list[str]) -> None:
    """Train, predict and compare as the module doc says; prints the report (JSON)."""
    import numpy as np
    import pyarrow.parquet as pq
    from sklearn.metrics import roc_auc_score

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.out or tmp
        for data in args.data:
            preds: dict[str, list[np.ndarray]] = {}
            labels = None
            rows = {}
            for variant, name in VARIANTS[data].items():
                if variant not in args.variants:
                    continue
                config = harness.CONFIGS / name
                test = None
                for seed in args.seeds:
                    rd = Path(tmp) / f"{data}-{variant}-{seed}"
                    out = Path(tmp) / f"{data}-{variant}-{seed}.parquet"
                    reused = out.is_file() and (rd / "summary.json").is_file()
                    if not reused:
                        test = test or harness.converted_test_split(config)
                        shutil.rmtree(rd, ignore_errors=True)
                        harness.train(
                            *[config, rd, f"train.seed={seed}", "distributed.nproc_per_node=1"],
                            *[f"train.batch_size={GLOBAL_BATCH[data]}", "checkpoint.enabled=true", *extra],
                        )
                        harness.cli("predict", rd, "--data", test, "--out", out)
                    t = pq.read_table(out)
                    y = t.column("label").to_numpy()
                    labels = y if labels is None else labels
                    assert np.array_equal(labels, y), "variants scored different rows"
                    preds.setdefault(variant, []).append(t.column("logit").to_numpy())
                    rows.setdefault(variant, []).append(_row(rd, seed))
                    if not reused:
                        print(data, variant, rows[variant][-1], flush=True)
            if args.train_only:
                continue
            point = {v: [roc_auc_score(labels, s) for s in preds[v]] for v in preds}
            diff = {}
            for pair in ("managed-hashmod", "managed-vocabulary"):
                a, b = pair.split("-")
                if a in preds and b in preds:
                    mean, ci95 = harness.paired_bootstrap(labels, preds[a], preds[b], roc_auc_score, n=args.boot)
                    diff[pair] = {"mean": mean, "ci95": ci95}
            report[data] = {
                "runs": rows,
                "auc_mean": {v: float(np.mean(a)) for v, a in point.items()},
                "diff": diff,
                "test_rows": len(labels),
            }
            print(json.dumps(report[data], indent=1), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
