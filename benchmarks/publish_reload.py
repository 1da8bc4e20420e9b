"""Reload time of a publish directory: incremental (only the new deltas, ``apply_versions``, what
``recsys-dist serve`` does on a reload) vs the full fold (``load_published``: the full version and
every delta), for a chain of ``--deltas`` deltas of the quickstart DLRM (26 tables x 10,000 rows x 16).

Trains the quickstart on 1 rank for ``deltas + 1`` steps with ``publish.every_n_steps: 1`` (one
version per step: a full version, then a delta per step of ~26 x 32 changed rows per table set,
and the dense weights), reusing a run already under ``--work``. Then times (median of
``--repeat``), on version k = 1 + deltas:

- full fold of version k (a fresh server start, and every reload before incremental reload);
- incremental reload from k-1 to k (one new delta) and from 1 to k (all deltas at once);
- full fold of version 1 + N for N = ``--full-every`` (a fresh start under ``publish.full_every: N``).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/publish_reload.py [--deltas 50] [--work DIR]
"""

from __future__ import annotations

from pathlib import Path

import harness


def train(run: Path, steps: int) -> None:
    """The quickstart on 1 rank for ``steps`` steps, publishing every step (unless ``run``
    already has that many versions)."""
    from recsys_dist.serve.publish import latest_version

    if latest_version(run / "publish") == steps:
        return
    harness.train(
        *[harness.CONFIGS / "criteo_quickstart.yaml", run, "distributed.nproc_per_node=1", f"train.max_steps={steps}"],
        *["checkpoint.every_n_steps=1", "checkpoint.keep=2", "publish.enabled=true", "publish.every_n_steps=1"],
    )


def timed(fn, repeat: int) -> float:
    """The median wall seconds of ``repeat`` calls of ``fn()``."""
    return harness.median(harness.seconds(fn, repeat))


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "publish_reload", "2 deltas, full_every 1, 1 repeat, in WORK/smoke")
    ap.add_argument("--deltas", type=int, default=50)
    ap.add_argument("--full-every", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/publish_reload"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.deltas, args.full_every, args.repeat, args.work = 2, 1, 1, args.work / "smoke"
    with harness.Results(args, argv):
        run_bench(args)


def run_bench(args) -> None:
    """Train (or reuse) the run, time the folds and reloads, print the table."""
    from recsys_dist.serve.publish import apply_versions, load_published

    run = args.work / "run"
    k = args.deltas + 1
    train(run, k)
    pub = run / "publish"
    first, _ = load_published(pub, 1)
    before, _ = load_published(pub, k - 1)
    rows = {
        f"full fold of v{k} (full + {args.deltas} deltas)": timed(lambda: load_published(pub, k), args.repeat),
        f"full fold of v{1 + args.full_every} (full + {args.full_every} deltas: full_every {args.full_every})": timed(
            lambda: load_published(pub, 1 + args.full_every), args.repeat
        ),
        "full fold of v1 (the full version alone)": timed(lambda: load_published(pub, 1), args.repeat),
        f"incremental v{k - 1} -> v{k} (1 delta)": timed(lambda: apply_versions(before, pub, k - 1, k), args.repeat),
        f"incremental v1 -> v{k} ({args.deltas} deltas)": timed(lambda: apply_versions(first, pub, 1, k), args.repeat),
    }
    print(f"publish reload, quickstart DLRM; median of {args.repeat}; {pub}\n\n| what | seconds |\n| --- | --- |")
    for what, s in rows.items():
        print(f"| {what} | {s:.3f} |")


if __name__ == "__main__":
    main()
