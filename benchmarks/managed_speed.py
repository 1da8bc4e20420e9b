"""Samples/s of managed-collision tables vs hash-mod at the same table sizes (issue 19 item 6).

Trains the shipped Avazu twins (configs/avazu_hashmod.yaml, configs/avazu_managed.yaml: the
same DeepFM, the same table sizes, 2 CPU ranks, one epoch of 113 steps) back to back and
reports each run's samples/s (summary.json), the managed remapping's ms per step (rank 0,
all_gather included; ``managed_remap_ms_per_step`` in metrics.jsonl) and test AUC. With
``--code DIR`` (repeatable) the managed run is made with each checkout's code (e.g. before
and after a change; the same test AUC shows the same remapping), the hash-mod run with the
first. The runs of a repeat go back to back, in ABBA order over the repeats (benchmarks/harness.py),
so slow phases of a shared machine hit both.

    .venv/bin/python benchmarks/managed_speed.py [--code DIR ...] [--repeats 1] [--out DIR]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import harness


def train(code: Path, config: str, run_dir: Path, extra: list[str]) -> dict:
    summary = harness.train(code / "configs" / config, run_dir, "checkpoint.enabled=false", *extra, code=code)
    return {
        "config": config,
        "code": str(code),
        "samples_per_s": summary["samples_per_s"],
        "remap_ms_per_step": harness.mean_metric(run_dir, "managed_remap_ms_per_step"),
        "test_auc": round(summary["test"]["auc"], 6),
        "wall_s": round(summary["wall_s"], 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "managed_speed", "4 steps a run")
    p.add_argument("--code", action="append", type=Path, help="checkout to run managed with (default: this one)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", help="keep the run directories here")
    p.add_argument(
        "overrides", nargs="*", help="config overrides for every run, e.g. data.managed.eviction_interval=10"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.overrides = [*args.overrides, *harness.SMOKE_TRAIN]
    with harness.Results(args, argv):
        run(args)


def run(args) -> None:
    """The runs of every repeat, alternating; prints each (JSON) and the table."""
    codes = [c.resolve() for c in (args.code or [harness.ROOT])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        for rep in range(args.repeats):
            runs = [(codes[0], "avazu_hashmod.yaml")] + [(c, "avazu_managed.yaml") for c in codes]
            for i, (code, config) in harness.abba_order(list(enumerate(runs)), rep):
                extra = [
                    o for o in args.overrides if config == "avazu_managed.yaml" or not o.startswith("data.managed")
                ]
                rows.append(train(code, config, out / f"{rep}-{i}-{config.removesuffix('.yaml')}", extra))
                print(json.dumps(rows[-1]), flush=True)
    base = [r["samples_per_s"] for r in rows if r["config"] == "avazu_hashmod.yaml"]
    hashmod = sum(base) / len(base)
    print("| config | code | samples/s | vs hash-mod (mean) | remap ms/step | test AUC |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = r["samples_per_s"] / hashmod
        print(
            f"| {r['config']} | {r['code']} | {r['samples_per_s']} | {ratio:.2f}x | "
            f"{r['remap_ms_per_step'] if r['remap_ms_per_step'] is not None else '-'} | {r['test_auc']:.4f} |"
        )


if __name__ == "__main__":
    main()
