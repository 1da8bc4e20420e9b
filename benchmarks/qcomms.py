"""fp32 vs fp16 output_dist comms (sharding.comms) on the Criteo quickstart split: test AUC
and logloss per seed, and a paired bootstrap over the test rows of the differences.

    PYTHONPATH=. .venv/bin/python benchmarks/qcomms.py --seeds 1 2 3 --out /tmp/qcomms

Each run trains configs/criteo_quickstart.yaml on 2 CPU ranks (gloo), table-wise tables so
that every pooled embedding crosses output_dist, once per precision and seed; both runs of a
seed start from the same weights and see the same batches. Results:
benchmarks/results/qcomms_cpu2core_20261201.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import harness


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


def metrics(logit, label) -> tuple[float, float]:
    """(AUC, logloss) of float logits against 0/1 labels (numpy arrays of the test rows)."""
    import numpy as np
    from sklearn.metrics import log_loss, roc_auc_score

    p = 1 / (1 + np.exp(-logit.astype(np.float64)))
    return roc_auc_score(label, p), log_loss(label, np.clip(p, 1e-7, 1 - 1e-7))


def diff_intervals(a: dict, b: dict, n: int = 1000, seed: int = 0) -> dict:
    """95% CI of metric(b) - metric(a) over test rows resampled with replacement (same rows for both)."""
    out = {}
    for i, name in enumerate(("auc", "logloss")):
        _, ci95 = harness.paired_bootstrap(
            a["label"], [b["logit"]], [a["logit"]], lambda y, logit, i=i: metrics(logit, y)[i], n=n, seed=seed
        )
        out[f"{name}_diff_ci95"] = ci95
    return out


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "qcomms", "seed 1, 4 steps a run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", default="/tmp/qcomms")
    ap.add_argument("--config", default="configs/criteo_quickstart.yaml")
    args = ap.parse_args(argv)
    extra = []
    if args.smoke:
        args.seeds, extra = args.seeds[:1], harness.SMOKE_TRAIN
    with harness.Results(args, argv):
        run(args, extra)


def run(args, extra: list[str]) -> None:
    """Both precisions per seed, one launch of 2 ranks each; prints a JSON row per seed."""
    import recsys_dist

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
                *extra,
            ]
            runs[prec] = recsys_dist.launch(job, 2, args.config, str(run_dir), overrides)[0]
        a, b = runs["fp32"], runs["fp16"]
        assert (a["label"] == b["label"]).all()
        row = {"seed": seed}
        for prec, r in runs.items():
            auc, ll = metrics(r["logit"], r["label"])
            row[prec] = {"auc": auc, "logloss": ll, "ledger_totals": r["ledger_totals"]}
        row.update(diff_intervals(a, b, n=50 if args.smoke else 1000))
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qcomms.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
