"""fp32 vs fp16 output_dist comms (sharding.comms) on the Criteo quickstart split: test AUC
and logloss per seed, and a paired bootstrap over the test rows of the differences.

    PYTHONPATH=. .venv/bin/python benchmarks/qcomms.py --seeds 1 2 3 --out /tmp/qcomms

Each run trains configs/criteo_quickstart.yaml on 2 CPU ranks (gloo), table-wise tables so
that every pooled embedding crosses output_dist, once per precision and seed; both runs of a
seed start from the same weights and see the same batches. Results:
benchmarks/results/qcomms_cpu2core_20261201.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks import side_by_side  # noqa: E402


def job(config: str, run_dir: str, overrides: list[str]) -> dict:
    import recsys_dist
    from recsys_dist.config.loader import load_config

    with recsys_dist.Trainer(load_config(config, overrides), run_dir) as trainer:
        summary = trainer.fit()
        preds = trainer.predict("test")
        led = json.loads(
            [ln for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if '"ledger"' in ln][0]
        )
    return {
        "summary": summary,
        "logit": preds["logit"].numpy(),
        "label": preds["label"].numpy(),
        "ledger_totals": led["totals"],
    }


def metrics(logit: np.ndarray, label: np.ndarray) -> tuple[float, float]:
    from sklearn.metrics import log_loss, roc_auc_score

    p = 1 / (1 + np.exp(-logit.astype(np.float64)))
    return roc_auc_score(label, p), log_loss(label, np.clip(p, 1e-7, 1 - 1e-7))


def paired_bootstrap(a: dict, b: dict, n: int = 1000, seed: int = 0) -> dict:
    """95% CI of metric(b) - metric(a) over test rows resampled with replacement (same rows for both)."""
    out = {}
    for i, name in enumerate(("auc", "logloss")):
        _, ci95 = side_by_side.paired_bootstrap(
            a["label"], [b["logit"]], [a["logit"]], lambda y, logit, i=i: metrics(logit, y)[i], n=n, seed=seed
        )
        out[f"{name}_diff_ci95"] = ci95
    return out


def main() -> None:
    import recsys_dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", default="/tmp/qcomms")
    ap.add_argument("--config", default="configs/criteo_quickstart.yaml")
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        runs = {}
        for prec in ("fp32", "fp16"):
            run_dir = Path(args.out) / f"seed{seed}_{prec}"
            overrides = [
                f"train.seed={seed}",
                f"sharding.comms.forward={prec}",
                f"sharding.comms.backward={prec}",
                "sharding.sharding_types=[table_wise]",
                "train.progress_bar=false",
                "checkpoint.enabled=false",
            ]
            runs[prec] = recsys_dist.launch(job, 2, args.config, str(run_dir), overrides)[0]
        a, b = runs["fp32"], runs["fp16"]
        assert (a["label"] == b["label"]).all()
        row = {"seed": seed}
        for prec, r in runs.items():
            auc, ll = metrics(r["logit"], r["label"])
            row[prec] = {"auc": auc, "logloss": ll, "ledger_totals": r["ledger_totals"]}
        row.update(paired_bootstrap(a, b))
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qcomms.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
