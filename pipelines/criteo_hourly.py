"""Cut the shipped Criteo sample into "hourly" partitions and land them in a directory, as a
log pipeline would, for ``configs/criteo_online.yaml`` (docs/online.md).

Criteo's Kaggle training file is in time order (7 days of traffic); its shipped first 10,000
rows are cut here into consecutive partitions of ``--rows`` rows, named like a lake's hourly
partitions (``day=0/hour=00/part-0.txt``, ``hour=01``, ...). Each is written to a hidden
temporary file and renamed into place, so a reader never sees half a partition. Usage:

    .venv/bin/python pipelines/criteo_hourly.py --out runs/criteo_online/landing
        [--rows 1000] [--every SECONDS] [--first N] [--count N] [--source FILE]

``--every S`` waits S seconds between two partitions (a live feed); ``--first`` / ``--count``
land only some of them (partition numbers from 0). The library never imports this file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from recsys_dist.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"


def partition_name(index: int, per_day: int = 24) -> str:
    """``day=D/hour=HH/part-0.txt`` of partition ``index`` (24 to a day)."""
    return f"day={index // per_day}/hour={index % per_day:02d}/part-0.txt"


def land(out: Path, name: str, lines: list[bytes]) -> Path:
    """Write ``lines`` to ``out/name`` atomically (``recsys_dist.files.write_atomic``: a hidden
    ``.NAME.RANDOM.tmp`` file, fsynced, then renamed, so a stream never reads half of it)."""
    target = out / name
    target.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(target, b"".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="landing directory (data.stream.path)")
    parser.add_argument("--source", default=str(SAMPLE), help="raw Criteo TSV in time order")
    parser.add_argument("--rows", type=int, default=1000, help="rows per partition")
    parser.add_argument("--every", type=float, default=0.0, help="seconds between two partitions")
    parser.add_argument("--first", type=int, default=0, help="first partition to land")
    parser.add_argument("--count", type=int, default=None, help="partitions to land (default: all)")
    args = parser.parse_args(argv)
    rows = Path(args.source).read_bytes().splitlines(keepends=True)
    parts = [rows[i : i + args.rows] for i in range(0, len(rows), args.rows)]
    last = len(parts) if args.count is None else min(len(parts), args.first + args.count)
    for i in range(args.first, last):
        if i > args.first and args.every:
            time.sleep(args.every)
        path = land(Path(args.out), partition_name(i), parts[i])
        print(f"landed {path} ({len(parts[i])} rows)", flush=True)


if __name__ == "__main__":
    main()
