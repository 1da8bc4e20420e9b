"""Replica groups (2-D sparse parallelism) against one group at 4 CPU ranks: bytes and rate.

``sharding.replica_groups``: the all-to-all bytes per rank per step and the replicas' sync
bytes (the run's ledger), the steady training rate, and the validation AUC.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/replica_groups.py --rounds 3 --record

Each run trains configs/criteo_quickstart.yaml (dlrm, 26 row_wise tables of 10,000 x 16,
exact_sgd, batch 32 per rank, the 8,000 training rows for up to 3 epochs) on 4 ranks (gloo, one
thread each) for ``--steps`` steps, validating at each epoch's end, no checkpoint: ``1d`` (one group of 4), ``2d`` (2 groups of 2,
synced every step) and ``2d_every8`` (synced every 8 steps). The contenders run in interleaved
(ABBA) rounds, because the machine is shared; the rate is ``harness.steady_rate`` (after the
first logged window), the ratio the median of the per-round ratios against ``1d``. On 2 cores
shared with other jobs, 4 ranks oversubscribe them: read the ratios, not the rates.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import harness

CONTENDERS = {
    "1d": [],
    "2d": ["sharding.replica_groups=2"],
    "2d_every8": ["sharding.replica_groups=2", "sharding.replica_sync_every=8"],
}
A2A = ("input_dist", "output_dist_forward", "output_dist_backward")


def run_once(name: str, out: Path, round_index: int, steps: int, extra: list[str]) -> dict:
    run_dir = out / f"{name}_{round_index}"
    overrides = [
        "distributed.nproc_per_node=4",
        "distributed.cpu_threads_per_rank=1",
        "sharding.sharding_types=[row_wise]",
        "train.embedding_optimizer=exact_sgd",
        f"train.max_steps={steps}",
        "train.epochs=3",
        f"train.log_every_n_steps={max(steps // 5, 1)}",
        "checkpoint.enabled=false",
        *CONTENDERS[name],
        *extra,
    ]
    summary = harness.train(harness.CONFIGS / "criteo_quickstart.yaml", run_dir, *overrides)
    lines = harness.metrics(run_dir)
    ledger = next(m for m in lines if m.get("split") == "ledger")
    rank0 = ledger["per_rank"][0]
    return {
        "rate": harness.steady_rate(lines, 32 * 4),
        "a2a_sent": sum(rank0[p]["sent"] for p in A2A),
        "sync_sent": rank0.get("replica_sync", {}).get("sent", 0),
        "allreduce_sent": rank0["allreduce"]["sent"],
        "auc": summary.get("validation", {}).get("auc"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "replica_groups", "1 round of 8 steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary one)")
    args = ap.parse_args(argv)
    extra = []
    if args.smoke:
        args.rounds, args.steps = 1, 8
    with harness.Results(args, argv):
        with tempfile.TemporaryDirectory() as tmp:
            out = args.out or Path(tmp)
            counter = {name: 0 for name in CONTENDERS}

            def contender(name: str):
                def go() -> dict:
                    counter[name] += 1
                    return run_once(name, out, counter[name], args.steps, extra)

                return go

            results = harness.abba(
                {n: contender(n) for n in CONTENDERS},
                args.rounds,
                lambda r, n, x: print(f"round {r} {n}: {x}", flush=True),
            )
        report(results)


def report(results: dict) -> None:
    base = results["1d"]
    print()
    print("| contender | all-to-all sent per rank per step | replica sync per rank per step | DDP all-reduce | "
          "steady rate (samples/s, median) | rate / 1d (median of rounds; min-max) | validation AUC |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rows in results.items():
        ratios = [r["rate"] / b["rate"] for r, b in zip(rows, base)]
        ratio = f"{harness.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        first = rows[0]
        print(
            f"| {name} | {harness_human(first['a2a_sent'])} | {harness_human(first['sync_sent'])} | "
            f"{harness_human(first['allreduce_sent'])} | {harness.median([r['rate'] for r in rows]):.1f} | "
            f"{ratio} | {first['auc']:.6f} |"
        )


def harness_human(n: float) -> str:
    for unit, size in (("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


if __name__ == "__main__":
    main()
