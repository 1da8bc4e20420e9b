"""Overlap under an injected network delay: base vs sparse_dist pipelines, fp32 vs fp16 comms,
at world size 2 on CPU (gloo), with and without a fixed delay per collective.

    PYTHONPATH=. .venv/bin/python benchmarks/overlap_delay.py --delays 0 2 --reps 5 --out /tmp/overlap

All runs share one launch of 2 ranks (a fresh Trainer each), in alternating order over the
rounds; it prints each run, then medians and paired ratios per delay.

No network namespace or tc netem here (no root network tools on the machine): the delay is
injected inside the collectives by recsys_dist.comm_counter.CommCounter(delay_ms=...): an
asynchronous collective's wait() returns no sooner than delay_ms after it was issued (so a
pipeline that issues early can hide it), a synchronous one sleeps delay_ms. It applies to
the collectives TorchRec issues from Python (input_dist's splits, lengths and ids
all-to-alls, output_dist's all-to-all / reduce-scatter and their backward); DDP's gradient
all-reduce (issued from C++) is not delayed. semi_sync and fused_sparse_dist do not run on
CPU (recsys_dist/train_pipeline.py says why). Results: benchmarks/results/overlap_delay_cpu2core_20261202.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

CASES = [("base", "fp32"), ("sparse_dist", "fp32"), ("sparse_dist", "fp16")]


def overrides_for(pipeline: str, prec: str, steps: int) -> list[str]:
    return [
        f"train.pipeline={pipeline}",
        f"sharding.comms.forward={prec}",
        f"sharding.comms.backward={prec}",
        "sharding.sharding_types=[table_wise]",
        f"train.max_steps={steps}",
        "train.timing_every_n_steps=10",
        "train.log_every_n_steps=10",
        "train.progress_bar=false",
        "checkpoint.enabled=false",
    ]


def job(config: str, out: str, delays: list[float], steps: int, reps: int) -> list[dict]:
    """Every (delay, pipeline, comms) run ``reps`` times on this rank, in ABC..CBA order, each a
    fresh Trainer (which makes and closes its own process group) in the ranks of one launch."""
    import warnings

    import recsys_dist
    from recsys_dist.comm_counter import CommCounter
    from recsys_dist.config import load_config

    warnings.filterwarnings("ignore")
    runs = [(d, p, c) for d in delays for p, c in CASES]
    rows = []
    for rep in range(reps):
        for delay, pipeline, prec in runs if rep % 2 == 0 else runs[::-1]:
            run_dir = Path(out) / f"r{rep}_d{delay:g}_{pipeline}_{prec}"
            cfg = load_config(config, overrides_for(pipeline, prec, steps))
            with recsys_dist.Trainer(cfg, run_dir) as trainer:
                with CommCounter(trainer.model, delay_ms=delay):
                    summary = trainer.fit()
            lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
            times = [{k: v for k, v in r.items() if k.startswith("time_")} for r in lines if r.get("split") == "train"]
            times = [t for t in times if t]
            keys = sorted({k for t in times for k in t})
            rows.append(
                {
                    "rep": rep,
                    "delay_ms": delay,
                    "pipeline": pipeline,
                    "comms": prec,
                    "samples_per_s": summary["samples_per_s"],
                    "mean_ms": {k: round(statistics.mean(t.get(k, 0) for t in times), 2) for k in keys},
                }
            )
    return rows


def main() -> None:
    import recsys_dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 2.0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--reps", type=int, default=1, help="rounds, alternating the order of the runs")
    ap.add_argument("--out", default="/tmp/overlap")
    ap.add_argument("--config", default="configs/criteo_quickstart.yaml")
    args = ap.parse_args()
    rows = recsys_dist.launch(job, 2, args.config, args.out, args.delays, args.steps, args.reps)[0]
    for row in rows:
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "overlap.json").write_text(json.dumps(rows, indent=2))

    def rates(delay, pipeline, prec):
        got = [r for r in rows if (r["delay_ms"], r["pipeline"], r["comms"]) == (delay, pipeline, prec)]
        return [r["samples_per_s"] for r in sorted(got, key=lambda r: r["rep"])]

    print("\nmedian samples/s and paired ratios (median over rounds):")
    for delay in args.delays:
        base, sd, fp16 = (rates(delay, p, c) for p, c in CASES)
        med = {f"{p}/{c}": round(statistics.median(x)) for (p, c), x in zip(CASES, (base, sd, fp16))}
        ratio = {
            "sparse_dist/base": round(statistics.median(b / a for a, b in zip(base, sd)), 3),
            "fp16/fp32 (sparse_dist)": round(statistics.median(b / a for a, b in zip(sd, fp16)), 3),
        }
        print(f"delay {delay:g} ms: {med}  {ratio}")
        for p, c in CASES:
            ms = [r["mean_ms"] for r in rows if (r["delay_ms"], r["pipeline"], r["comms"]) == (delay, p, c)]
            keys = sorted({k for m in ms for k in m})
            print(
                f"  {p}/{c} mean ms: "
                + ", ".join(f"{k[5:]} {statistics.median(m.get(k, 0) for m in ms):.2f}" for k in keys)
            )


if __name__ == "__main__":
    main()
