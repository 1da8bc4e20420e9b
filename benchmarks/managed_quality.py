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

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from sklearn.metrics import roc_auc_score

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "recsys_dist.cli"]
VARIANTS = {
    "movielens": {
        "managed": "movielens_managed.yaml",
        "hashmod": "movielens_hashmod.yaml",
        "vocabulary": "movielens_deepfm.yaml",
    },
    "avazu": {"managed": "avazu_managed.yaml", "hashmod": "avazu_hashmod.yaml", "vocabulary": "avazu_vocabulary.yaml"},
}
GLOBAL_BATCH = {"movielens": 128, "avazu": 64}


def run(args: list[str]) -> str:
    r = subprocess.run(
        CLI + args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if r.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def test_split(config: Path) -> Path:
    out = run(["preprocess", "--config", str(config)])
    manifest = next(line.split("manifest:")[1].strip() for line in out.splitlines() if "manifest:" in line)
    return Path(manifest).parent / "test.parquet"


def _row(rd: Path, seed: int) -> dict:
    summary = json.loads((rd / "summary.json").read_text())
    lines = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    test_line = next(m for m in lines if m["split"] == "test")
    remap = [m["managed_remap_ms_per_step"] for m in lines if "managed_remap_ms_per_step" in m]
    return {
        "seed": seed,
        "test_auc": test_line["auc"],
        "samples_per_s": summary.get("samples_per_s"),
        "remap_ms_per_step": round(sum(remap) / len(remap), 2) if remap else None,
        "default_share": {f: v["default_share"] for f, v in test_line.get("managed", {}).items()},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--boot", type=int, default=1000)
    p.add_argument("--data", nargs="+", default=list(VARIANTS))
    p.add_argument("--variants", nargs="+", default=["managed", "hashmod", "vocabulary"])
    p.add_argument("--out", help="keep runs and predictions here; runs already there are reused")
    p.add_argument("--train-only", action="store_true", help="train and predict, no comparison")
    args = p.parse_args()
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
                config = ROOT / "configs" / name
                test = None
                for seed in args.seeds:
                    rd = Path(tmp) / f"{data}-{variant}-{seed}"
                    out = Path(tmp) / f"{data}-{variant}-{seed}.parquet"
                    if out.is_file() and (rd / "summary.json").is_file():
                        rows.setdefault(variant, []).append(_row(rd, seed))
                        preds.setdefault(variant, []).append(pq.read_table(out).column("logit").to_numpy())
                        labels = pq.read_table(out).column("label").to_numpy()
                        continue
                    test = test or test_split(config)
                    shutil.rmtree(rd, ignore_errors=True)
                    run(
                        ["train", "--config", str(config), "--run-dir", str(rd), f"train.seed={seed}"]
                        + ["distributed.nproc_per_node=1", f"train.batch_size={GLOBAL_BATCH[data]}"]
                        + ["train.progress_bar=false", "checkpoint.enabled=true"]
                    )
                    run(["predict", str(rd), "--data", str(test), "--out", str(out)])
                    t = pq.read_table(out)
                    y = t.column("label").to_numpy()
                    labels = y if labels is None else labels
                    assert np.array_equal(labels, y), "variants scored different rows"
                    preds.setdefault(variant, []).append(t.column("logit").to_numpy())
                    rows.setdefault(variant, []).append(_row(rd, seed))
                    print(data, variant, rows[variant][-1], flush=True)
            if args.train_only:
                continue
            rng = np.random.default_rng(0)
            n = len(labels)
            boots = {"managed-hashmod": [], "managed-vocabulary": []}
            for _ in range(args.boot):
                idx = rng.integers(0, n, n)
                if labels[idx].min() == labels[idx].max():
                    continue
                auc = {v: [roc_auc_score(labels[idx], s[idx]) for s in preds[v]] for v in preds}
                for pair in boots:
                    a, b = pair.split("-")
                    boots[pair].append(float(np.mean(np.array(auc[a]) - np.array(auc[b]))))
            point = {v: [roc_auc_score(labels, s) for s in preds[v]] for v in preds}
            report[data] = {
                "runs": rows,
                "auc_mean": {v: float(np.mean(a)) for v, a in point.items()},
                "diff": {
                    pair: {
                        "mean": float(
                            np.mean(np.array(point[pair.split("-")[0]]) - np.array(point[pair.split("-")[1]]))
                        ),
                        "ci95": [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))],
                    }
                    for pair, d in boots.items()
                },
                "test_rows": n,
            }
            print(json.dumps(report[data], indent=1), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
