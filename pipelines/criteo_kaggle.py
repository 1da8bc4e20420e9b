"""End to end on Criteo Kaggle-format data: raw TSV -> Parquet -> train -> evaluate -> predict.

Thin over the library's CLI (the library never imports this file). Usage:

    .venv/bin/python pipelines/criteo_kaggle.py [--config configs/criteo_quickstart.yaml]
        [--run-dir runs/pipeline-<time>] [dotted.key=value ...]

Steps: ``recsys-dist preprocess`` (cached conversion, bad rows per ``data.on_bad_row``),
``recsys-dist train``, ``recsys-dist report``, ``recsys-dist export``, then ``evaluate`` and
``predict`` of the exported model on the test split's Parquet file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "recsys_dist.cli.main", *args], cwd=ROOT, text=True, stdout=subprocess.PIPE
    )
    if r.returncode:
        sys.exit(r.returncode)
    return r.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "criteo_quickstart.yaml"))
    parser.add_argument(
        "--run-dir",
        default=str(ROOT / "runs" / f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}"),
        help="a new directory (an existing run is never trained over)",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run = Path(args.run_dir)
    out = cli("preprocess", "--config", args.config, "--quiet", *args.overrides)
    print(out, end="")
    manifest = Path(out.split("manifest: ")[1].split()[0])
    test_parquet = manifest.parent / "test.parquet"
    print(
        cli("train", "--config", args.config, "--run-dir", str(run), "train.progress_bar=false", *args.overrides),
        end="",
    )
    print(cli("report", str(run)), end="")
    print(cli("export", str(run), "--out", str(run / "export")), end="")
    metrics = json.loads(cli("evaluate", str(run / "export"), "--data", str(test_parquet)).strip().splitlines()[-1])
    print(f"exported model on the test split: AUC {metrics['auc']:.4f}, logloss {metrics['logloss']:.4f}")
    print(
        cli(
            "predict", str(run / "export"), "--data", str(test_parquet), "--out", str(run / "test_predictions.parquet")
        ),
        end="",
    )


if __name__ == "__main__":
    main()
