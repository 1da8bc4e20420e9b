"""Data pipeline: preprocessing and loading rates against their ceilings, and peak memory.

Input: the shipped real Criteo rows (datasets/criteo_kaggle, 10,000 rows) repeated to
``--rows`` and to 10x that, written once to a temporary directory. Every figure is measured
in this run, each in a fresh subprocess (so peak RSS is that step's alone):

1. preprocessing rows/s: recsys_dist's TSV -> Parquet conversion vs pyarrow's CSV reader
   reading the same file alone (the ceiling), and vs TorchRec's TSV -> npy converter
   (``BinaryCriteoUtils.tsv_to_npys``);
2. peak RSS of preprocessing and of one loading epoch, 10x input vs 1x;
3. loader samples/s (batch 4096, one rank, 65,536-row shuffle windows, prefetch on) vs a bare pyarrow scan of the same
   Parquet columns (the ceiling), and vs the rate at which the quickstart model consumes
   batches (its samples/s from a 2-rank quickstart run).

    .venv/bin/python benchmarks/data_pipeline.py [--rows 200000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"

STEPS = {
    "convert": """
        from recsys_dist.data.criteo import prepare_criteo
        p = prepare_criteo(RAW, 100000, cache_dir=TMP + "/cache_" + TAG)
        out = {"rows": sum(p.rows.values()), "parquet": str(p.files["train"])}
    """,
    "pyarrow_csv": """
        import pyarrow as pa, pyarrow.csv as pacsv
        from recsys_dist.data.criteo import COLUMNS
        t = pacsv.read_csv(RAW, read_options=pacsv.ReadOptions(column_names=COLUMNS),
                           parse_options=pacsv.ParseOptions(delimiter="\\t", quote_char=False))
        out = {"rows": t.num_rows}
    """,
    "torchrec_npy": """
        from torchrec.datasets.criteo import BinaryCriteoUtils
        BinaryCriteoUtils.tsv_to_npys(RAW, TMP + "/d.npy", TMP + "/s.npy", TMP + "/l.npy", dataset_name="criteo_kaggle")
        out = {"rows": ROWS}
    """,
    "load": """
        from recsys_dist.data.criteo import DENSE_NAMES, SPARSE_NAMES
        from recsys_dist.data.loader import ParquetBatchLoader
        loader = ParquetBatchLoader(PARQUET, 4096, 0, 1, DENSE_NAMES, SPARSE_NAMES, shuffle=SHUFFLE,
                                    shuffle_buffer_rows=1 << 16)
        n = 0
        t0 = time.perf_counter()
        for b in loader:
            n += int(b.weights.sum())
        out = {"rows": n, "seconds": time.perf_counter() - t0}
    """,
    "scan": """
        import pyarrow.parquet as pq
        from recsys_dist.data.criteo import COLUMNS
        n = 0
        t0 = time.perf_counter()
        for rb in pq.ParquetFile(PARQUET).iter_batches(batch_size=4096, columns=COLUMNS):
            cols = [c.to_numpy() for c in rb.columns]
            n += rb.num_rows
        out = {"rows": n, "seconds": time.perf_counter() - t0}
    """,
}


def run_step(name: str, **params) -> dict:
    body = textwrap.dedent(STEPS[name])
    code = "\n".join([
        "import json, resource, sys, time, warnings", "warnings.filterwarnings('ignore')",
        f"sys.path.insert(0, {str(ROOT)!r})",
        *(f"{k} = {v!r}" for k, v in params.items()),
        "t_start = time.perf_counter()", body,
        "out.setdefault('seconds', time.perf_counter() - t_start)",
        "out['peak_rss_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024",
        "print(json.dumps(out))"])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def make_input(path: Path, rows: int) -> None:
    lines = SAMPLE.read_bytes()
    with open(path, "wb") as f:
        for _ in range(rows // 10000):
            f.write(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000, help="size of the 1x input (multiple of 10,000)")
    parser.add_argument("--quick", action="store_true", help="100,000-row 1x input")
    parser.add_argument("--consume-rate", type=float, default=None,
                        help="quickstart samples/s to compare with (default: read runs/*/summary.json)")
    args = parser.parse_args()
    rows = 100_000 if args.quick else args.rows
    with tempfile.TemporaryDirectory() as tmp:
        res = {}
        for tag, n in (("1x", rows), ("10x", 10 * rows)):
            raw = Path(tmp) / f"{tag}.txt"
            make_input(raw, n)
            common = dict(RAW=str(raw), TMP=tmp, TAG=tag, ROWS=n)
            conv = run_step("convert", **common)
            res[tag] = {"convert": conv, "csv": run_step("pyarrow_csv", **common),
                        "load": run_step("load", PARQUET=conv["parquet"], SHUFFLE=True),
                        "load_ordered": run_step("load", PARQUET=conv["parquet"], SHUFFLE=False),
                        "scan": run_step("scan", PARQUET=conv["parquet"])}
            if tag == "1x":
                res[tag]["torchrec"] = run_step("torchrec_npy", **common)
            raw.unlink()
    one, ten = res["1x"], res["10x"]
    rate = lambda r: r["rows"] / r["seconds"]  # noqa: E731
    consume = args.consume_rate
    if consume is None:
        found = [json.loads(p.read_text()).get("samples_per_s") for p in (ROOT / "runs").glob("*/summary.json")]
        consume = max((f for f in found if f), default=None)
    print(f"inputs: {rows:,} and {10 * rows:,} real Criteo rows (the shipped sample repeated)")
    print(f"preprocess rows/s (10x input): {rate(ten['convert']):,.0f}; pyarrow CSV read alone "
          f"{rate(ten['csv']):,.0f} -> ratio {rate(ten['convert']) / rate(ten['csv']):.2f}")
    print(f"preprocess vs TorchRec tsv_to_npys ({rows:,} rows): {rate(one['convert']):,.0f} vs "
          f"{rate(one['torchrec']):,.0f} rows/s -> ratio {rate(one['convert']) / rate(one['torchrec']):.1f}")
    print(f"preprocess peak RSS: {one['convert']['peak_rss_mb']:.0f} MB (1x) vs {ten['convert']['peak_rss_mb']:.0f} MB "
          f"(10x) -> ratio {ten['convert']['peak_rss_mb'] / one['convert']['peak_rss_mb']:.2f}")
    print(f"loader peak RSS: {one['load']['peak_rss_mb']:.0f} MB (1x) vs {ten['load']['peak_rss_mb']:.0f} MB (10x) "
          f"-> ratio {ten['load']['peak_rss_mb'] / one['load']['peak_rss_mb']:.2f}")
    print(f"loader samples/s (10x, batch 4096): shuffled {rate(ten['load']):,.0f}, in file order "
          f"{rate(ten['load_ordered']):,.0f}; bare pyarrow scan {rate(ten['scan']):,.0f} -> ratios "
          f"{rate(ten['load']) / rate(ten['scan']):.2f} / {rate(ten['load_ordered']) / rate(ten['scan']):.2f}")
    if consume:
        print(f"loader vs the quickstart model's consumption ({consume:,.0f} samples/s): "
              f"ratio {rate(ten['load']) / consume:.1f}")


if __name__ == "__main__":
    main()
