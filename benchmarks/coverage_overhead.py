"""What counting the tables' coverage costs a hash-mapped conversion (issue 40 item 9).

A synthetic Criteo TSV (``--rows`` rows, each categorical column half Zipf-distributed, half
uniform over up to ``--distinct`` values, so the largest columns overflow the 65,536-key sketch) is converted with
``coverage=True`` and ``coverage=False`` (``recsys_dist.data.convert.prepare``), each round into a
fresh cache directory, the two interleaved (``--rounds`` rounds), and the median time of each is
printed with their ratio. Run: ``PYTHONPATH=. python benchmarks/coverage_overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.criteo import CRITEO


def write_criteo(path: Path, rows: int, distinct: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    cols = [rng.integers(0, 2, rows).astype(str)]
    cols += [rng.integers(0, 100, rows).astype(str) for _ in range(13)]
    for j in range(26):
        # Half Zipf (a long head), half uniform over this column's vocabulary: columns range from
        # 10 to `distinct` values, the largest with more distinct values than the sketch keeps.
        n = max(10, int(distinct / (1.6**j)))
        zipf = np.minimum(rng.zipf(1.2, rows), n)
        ranks = np.where(rng.random(rows) < 0.5, zipf, rng.integers(1, n + 1, rows)) + j * 10_000_000
        cols.append(np.char.mod("%08x", ranks))
    with open(path, "w") as f:
        for i in range(0, rows, 50_000):
            block = ["\t".join(parts) for parts in zip(*(c[i : i + 50_000] for c in cols))]
            f.write("\n".join(block) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--distinct", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "synthetic.txt"
        write_criteo(raw, args.rows, args.distinct)
        wall: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for coverage in (True, False) if r % 2 == 0 else (False, True):
                t, c = time.perf_counter(), time.process_time()  # CPU time: all threads of this process
                p = prepare(
                    ConversionSpec(CRITEO, raw, 100_000, cache_dir=Path(tmp) / f"c{r}{coverage}"), coverage=coverage
                )
                wall[coverage].append(time.perf_counter() - t)
                cpu[coverage].append(time.process_time() - c)
                if coverage:
                    manifest = json.loads((p.directory / "manifest.json").read_text())
        cov = manifest["categorical_mapping"]["coverage"]
        inexact = [n for n, t in cov.items() if not t["exact"]]
        print(f"rows {args.rows:,}; features over the sketch (estimated): {len(inexact)} of 26")
        for name, d in (("wall", wall), ("CPU", cpu)):
            on, off = statistics.median(d[True]), statistics.median(d[False])
            print(f"{name} s, coverage on : median {on:.2f}  {sorted(round(x, 2) for x in d[True])}")
            print(f"{name} s, coverage off: median {off:.2f}  {sorted(round(x, 2) for x in d[False])}")
            print(f"{name} ratio on/off: {on / off:.3f}")


if __name__ == "__main__":
    main()
