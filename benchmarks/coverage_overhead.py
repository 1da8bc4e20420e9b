"""What counting the tables' coverage costs a hash-mapped conversion (issue 40 item 9).

A synthetic Criteo TSV (``--rows`` rows, each categorical column half Zipf-distributed, half
uniform over up to ``--distinct`` values, so the largest columns overflow the 65,536-key sketch) is converted with
``coverage=True`` and ``coverage=False`` (``recsys_dist.data.convert.prepare``), each round into a
fresh cache directory, the two interleaved (``--rounds`` rounds, ABBA order), and the median time of
each is printed with their ratio. Run: ``PYTHONPATH=. python benchmarks/coverage_overhead.py``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import harness


def write_criteo(path: Path, rows: int, distinct: int, seed: int = 0) -> None:
    """The synthetic TSV of the module doc: ``rows`` rows, 26 columns of up to ``distinct`` values."""
    import numpy as np

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


class Coverage:
    """The bench (:class:`harness.Bench`): contenders coverage on / off; a round converts ``raw``
    into a fresh cache directory and returns (wall s, CPU s of every thread of this process,
    the manifest's coverage)."""

    def __init__(self, raw: Path, tmp: Path) -> None:
        self.raw, self.tmp, self.rounds = raw, tmp, 0

    def contenders(self) -> list[str]:
        return ["on", "off"]

    def run_round(self, contender: str) -> tuple[float, float, dict]:
        from recsys_dist.data.convert import ConversionSpec, prepare
        from recsys_dist.data.formats.criteo import CRITEO

        self.rounds += 1
        t, c = time.perf_counter(), time.process_time()  # CPU time: all threads of this process
        spec = ConversionSpec(CRITEO, self.raw, 100_000, cache_dir=self.tmp / f"c{self.rounds}")
        p = prepare(spec, coverage=contender == "on")
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        manifest = json.loads((p.directory / "manifest.json").read_text())
        return wall, cpu, manifest["categorical_mapping"].get("coverage", {})


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "coverage_overhead", "3,000 rows, 2,000 distinct values, 2 rounds")
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--distinct", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.distinct, args.rounds = 3000, 2000, 2
    with harness.Results(args, argv), tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "synthetic.txt"
        write_criteo(raw, args.rows, args.distinct)
        got = harness.run_bench(Coverage(raw, Path(tmp)), args.rounds)
        inexact = [n for n, t in got["on"][-1][2].items() if not t["exact"]]
        print(f"rows {args.rows:,}; features over the sketch (estimated): {len(inexact)} of 26")
        for i, name in ((0, "wall"), (1, "CPU")):
            on, off = ([r[i] for r in got[k]] for k in ("on", "off"))
            print(f"{name} s, coverage on : median {harness.median(on):.2f}  {sorted(round(x, 2) for x in on)}")
            print(f"{name} s, coverage off: median {harness.median(off):.2f}  {sorted(round(x, 2) for x in off)}")
            print(f"{name} ratio on/off: {harness.median(on) / harness.median(off):.3f}")


if __name__ == "__main__":
    main()
