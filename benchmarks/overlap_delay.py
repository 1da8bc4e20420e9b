"""Overlap under an injected network delay: base vs sparse_dist pipelines, fp32 vs fp16 comms,
at world size 2 on CPU (gloo), with and without a fixed delay per collective.

    PYTHONPATH=. .venv/bin/python benchmarks/overlap_delay.py --delays 0 2 --out /tmp/overlap

No network namespace or tc netem here (no root network tools on the machine): the delay is
injected inside the collectives by recsys_dist.comm_counter.CommCounter(delay_ms=...): an
asynchronous collective's wait() returns no sooner than delay_ms after it was issued (so a
pipeline that issues early can hide it), a synchronous one sleeps delay_ms. It applies to
the collectives TorchRec issues from Python (input_dist's splits, lengths and ids
all-to-alls, output_dist's all-to-all / reduce-scatter and their backward); DDP's gradient
all-reduce (issued from C++) is not delayed. semi_sync and fused_sparse_dist do not run on
CPU (recsys_dist/train_pipeline.py says why). Results: benchmarks/results/overlap_delay_cpu2core_20261201.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def job(config: str, run_dir: str, overrides: list[str], delay_ms: float) -> dict:
    import recsys_dist
    from recsys_dist.comm_counter import CommCounter
    from recsys_dist.config import load_config

    with recsys_dist.Trainer(load_config(config, overrides), run_dir) as trainer:
        with CommCounter(trainer.model, delay_ms=delay_ms):
            summary = trainer.fit()
    times = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    breakdown = [{k: v for k, v in r.items() if k.startswith("time_")} for r in times if r.get("split") == "train"]
    return {"summary": summary, "breakdown": [b for b in breakdown if b]}


def main() -> None:
    import recsys_dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 2.0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--out", default="/tmp/overlap")
    ap.add_argument("--config", default="configs/criteo_quickstart.yaml")
    args = ap.parse_args()
    cases = [("base", "fp32"), ("sparse_dist", "fp32"), ("sparse_dist", "fp16")]
    rows = []
    for delay in args.delays:
        for pipeline, prec in cases:
            run_dir = Path(args.out) / f"d{delay:g}_{pipeline}_{prec}"
            overrides = [
                f"train.pipeline={pipeline}",
                f"sharding.comms.forward={prec}",
                f"sharding.comms.backward={prec}",
                "sharding.sharding_types=[table_wise]",
                f"train.max_steps={args.steps}",
                "train.timing_every_n_steps=10",
                "train.log_every_n_steps=10",
                "train.progress_bar=false",
                "checkpoint.enabled=false",
            ]
            r = recsys_dist.launch(job, 2, args.config, str(run_dir), overrides, delay)[0]
            row = {
                "delay_ms": delay,
                "pipeline": pipeline,
                "comms": prec,
                "samples_per_s": r["summary"]["samples_per_s"],
            }
            if r["breakdown"]:
                keys = sorted({k for b in r["breakdown"] for k in b})
                row["mean_ms"] = {
                    k: round(sum(b.get(k, 0) for b in r["breakdown"]) / len(r["breakdown"]), 2) for k in keys
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "overlap.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
