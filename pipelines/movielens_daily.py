"""Cut the shipped MovieLens sample into partitions in time order and land them in a directory,
as a log pipeline would, for ``configs/movielens_hstu_online.yaml`` (docs/online.md).

The shipped ``ratings_genres_first20000_by_time.csv`` lists each user's ratings in time order,
user after user; a log lands in time order across users, so its rows are sorted here by
``timestamp`` (stable: a user's ties keep their file order) and cut into consecutive partitions of
``--rows`` rows (``day=000/part-0.csv``, ``day=001``, ...; each with the CSV header). A user's
ratings then spread over many partitions, and its history in a later one is carried from the
earlier ones (``data.stream.histories: carry``). Each partition is written to a hidden temporary
file and renamed into place, so a reader never sees half a partition. Usage:

    .venv/bin/python pipelines/movielens_daily.py --out runs/movielens_online/landing
        [--rows 2000] [--every SECONDS] [--first N] [--count N] [--source FILE]

``--every S`` waits S seconds between two partitions (a live feed); ``--first`` / ``--count``
land only some of them (partition numbers from 0). The library never imports this file.
"""

from __future__ import annotations

import argparse
import csv
import io
import time
from pathlib import Path

from recsys_dist.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "movielens" / "ratings_genres_first20000_by_time.csv"


def land(out: Path, name: str, text: str) -> Path:
    """Write ``text`` to ``out/name`` atomically (``recsys_dist.files.write_atomic``: a hidden
    ``.NAME.RANDOM.tmp`` file, fsynced, then renamed, so a stream never reads half of it)."""
    target = out / name
    target.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(target, text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="landing directory (data.stream.path)")
    parser.add_argument("--source", default=str(SAMPLE), help="MovieLens ratings CSV with a timestamp column")
    parser.add_argument("--rows", type=int, default=2000, help="rows per partition")
    parser.add_argument("--every", type=float, default=0.0, help="seconds between two partitions")
    parser.add_argument("--first", type=int, default=0, help="first partition to land")
    parser.add_argument("--count", type=int, default=None, help="partitions to land (default: all)")
    args = parser.parse_args(argv)
    with open(args.source, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = sorted(reader, key=lambda row: int(row[header.index("timestamp")]))
    parts = [rows[i : i + args.rows] for i in range(0, len(rows), args.rows)]
    last = len(parts) if args.count is None else min(len(parts), args.first + args.count)
    for i in range(args.first, last):
        if i > args.first and args.every:
            time.sleep(args.every)
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([header, *parts[i]])
        path = land(Path(args.out), f"day={i:03d}/part-0.csv", text.getvalue())
        print(f"landed {path} ({len(parts[i])} rows)", flush=True)


if __name__ == "__main__":
    main()
