"""Test AUC / logloss of every model on the shipped Criteo and Avazu samples, over seeds.

Criteo: the quickstart split (8,000 / 1,000 / 1,000 rows in file order); Avazu: 7,199 / 900 /
900 rows in file order. 2 CPU ranks,
the config of each model in configs/. Prints mean and spread (min-max) per model.

    .venv/bin/python benchmarks/model_quality.py [--seeds 0 1 2]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import harness

CONFIGS = {
    "criteo dlrm": "criteo_quickstart.yaml",
    "criteo dcnv2": "criteo_dcnv2.yaml",
    "criteo deepfm": "criteo_deepfm.yaml",
    "criteo wide_deep": "criteo_wide_deep.yaml",
    "avazu dcnv2": "avazu_dcnv2.yaml",
    "avazu deepfm": "avazu_deepfm.yaml",
    "avazu wide_deep": "avazu_wide_deep.yaml",
}


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, "model_quality", "criteo dlrm only, the first seed, 4 steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    configs, extra = CONFIGS, []
    if args.smoke:
        configs, args.seeds, extra = {"criteo dlrm": CONFIGS["criteo dlrm"]}, args.seeds[:1], harness.SMOKE_TRAIN
    with harness.Results(args, argv):
        print(f"{'model':<17}{'test AUC mean':>14}{'AUC min-max':>18}{'test logloss mean':>19}   (seeds {args.seeds})")
        with tempfile.TemporaryDirectory() as tmp:
            for name, config in configs.items():
                tests = [
                    harness.train(
                        harness.CONFIGS / config,
                        Path(tmp) / f"{name}-{seed}",
                        f"train.seed={seed}",
                        "checkpoint.enabled=false",
                        *extra,
                    )["test"]
                    for seed in args.seeds
                ]
                aucs, losses = [t["auc"] for t in tests], [t["logloss"] for t in tests]
                print(
                    f"{name:<17}{statistics.mean(aucs):>14.4f}{min(aucs):>10.4f}-{max(aucs):.4f}"
                    f"{statistics.mean(losses):>19.4f}"
                )


if __name__ == "__main__":
    main()
