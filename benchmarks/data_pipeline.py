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
   batches (its samples/s from a 2-rank quickstart run);
4. rank 0 of 2: samples/s when it reads the whole stream (``data.rank_reads: global_batch``)
   vs only its own row groups (``row_groups``).

The speeds (3, 4) are measured in one process, in ``--repeats`` interleaved rounds (scan,
shuffled, in file order, global_batch, row_groups, then the reverse: ABBA), each measure's fastest epoch
counting: the first epoch pays warm-up, and on a shared machine a busy spell then slows every
measure of a round alike instead of one of them.

    .venv/bin/python benchmarks/data_pipeline.py [--rows 200000] [--quick] [--repeats 5]
"""

from __future__ import annotations

import json
import tempfile
import textwrap
from pathlib import Path

import harness

STEPS = {
    "convert": """
        from recsys_dist.data.convert import ConversionSpec, prepare
        from recsys_dist.data.formats.criteo import CRITEO
        t_start = time.perf_counter()  # imports are not conversion time (torchrec's take 2 s)
        p = prepare(ConversionSpec(CRITEO, RAW, 100000, cache_dir=TMP + "/cache_" + TAG))
        out = {"rows": sum(p.rows.values()), "parquet": str(p.files["train"])}
    """,
    "pyarrow_csv": """
        import pyarrow as pa, pyarrow.csv as pacsv
        from recsys_dist.data.formats.criteo import COLUMNS
        t_start = time.perf_counter()
        t = pacsv.read_csv(RAW, read_options=pacsv.ReadOptions(column_names=COLUMNS),
                           parse_options=pacsv.ParseOptions(delimiter="\\t", quote_char=False))
        out = {"rows": t.num_rows}
    """,
    "torchrec_npy": """
        from torchrec.datasets.criteo import BinaryCriteoUtils
        t_start = time.perf_counter()
        BinaryCriteoUtils.tsv_to_npys(RAW, TMP + "/d.npy", TMP + "/s.npy", TMP + "/l.npy", dataset_name="criteo_kaggle")
        out = {"rows": ROWS}
    """,
    "load": """
        from recsys_dist.data.formats.criteo import DENSE_NAMES, SPARSE_NAMES
        from recsys_dist.data.loader import ParquetBatchLoader
        loader = ParquetBatchLoader(PARQUET, 4096, 0, 1, DENSE_NAMES, SPARSE_NAMES, shuffle=True,
                                    shuffle_buffer_rows=1 << 16)
        n = 0
        t0 = time.perf_counter()
        for b in loader:
            n += int(b.weights.sum())
        out = {"rows": n, "seconds": time.perf_counter() - t0}
    """,
    "speed": """
        import harness
        import pyarrow.parquet as pq
        from recsys_dist.data.formats.criteo import COLUMNS, DENSE_NAMES, SPARSE_NAMES
        from recsys_dist.data.loader import ParquetBatchLoader

        def scan(epoch):
            n = 0
            for rb in pq.ParquetFile(PARQUET).iter_batches(batch_size=4096, columns=COLUMNS):
                cols = [c.to_numpy() for c in rb.columns]
                n += rb.num_rows
            return n

        def loader(shuffle, rank=0, world_size=1, mode="global_batch"):
            l = ParquetBatchLoader(PARQUET, 4096, rank, world_size, DENSE_NAMES, SPARSE_NAMES, shuffle=shuffle,
                                   shuffle_buffer_rows=1 << 16, rank_reads=mode)

            def epoch(e):
                l.set_epoch(e)
                return sum(int(b.weights.sum()) for b in l)
            return epoch

        def timed(f):
            epochs = iter(range(REPEATS))
            def run():
                t0 = time.perf_counter()
                n = f(next(epochs))
                return {"rows": n, "seconds": time.perf_counter() - t0}
            return run

        runs = {"scan": scan, "shuffled": loader(True), "ordered": loader(False),
                "global_batch": loader(True, 0, 2), "row_groups": loader(True, 0, 2, "row_groups")}
        # interleaved (ABBA): a busy spell of a shared machine hits every measure alike
        rounds = harness.abba({k: timed(f) for k, f in runs.items()}, REPEATS)
        out = {k: min(v, key=lambda r: r["seconds"]) for k, v in rounds.items()}  # the fastest epoch counts
    """,
}


def run_step(name: str, **params) -> dict:
    """Step ``name`` of :data:`STEPS` in a fresh Python (its globals ``params``); its result
    with ``seconds`` and the process's ``peak_rss_mb``."""
    body = textwrap.dedent(STEPS[name])
    code = "\n".join(
        [
            "import json, resource, sys, time, warnings",
            "warnings.filterwarnings('ignore')",
            *(f"{k} = {v!r}" for k, v in params.items()),
            "t_start = time.perf_counter()",
            body,
            "out.setdefault('seconds', time.perf_counter() - t_start)",
            "out['peak_rss_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024",
            "print(json.dumps(out))",
        ]
    )
    return harness.last_json(harness.python(code))


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, "data_pipeline", "10,000-row 1x input, 1 round")
    parser.add_argument("--rows", type=int, default=200_000, help="size of the 1x input (multiple of 10,000)")
    parser.add_argument("--quick", action="store_true", help="100,000-row 1x input")
    parser.add_argument(
        "--consume-rate",
        type=float,
        default=None,
        help="quickstart samples/s to compare with (default: read runs/*/summary.json)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="rounds of the loader-speed measures; each measure's fastest epoch counts",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.quick, args.repeats = 10_000, False, 1
    with harness.Results(args, argv):
        run(args)


def run(args) -> None:
    """Every step in its own process, then one line per measure."""
    rows = 100_000 if args.quick else args.rows
    with tempfile.TemporaryDirectory() as tmp:
        res = {}
        for tag, n in (("1x", rows), ("10x", 10 * rows)):
            raw = Path(tmp) / f"{tag}.txt"
            harness.criteo_sample(raw, n // 10_000)
            common = dict(RAW=str(raw), TMP=tmp, TAG=tag, ROWS=n)
            conv = run_step("convert", **common)
            res[tag] = {
                "convert": conv,
                "csv": run_step("pyarrow_csv", **common),
                "load": run_step("load", PARQUET=conv["parquet"]),
            }
            if tag == "10x":
                res[tag]["speed"] = run_step("speed", PARQUET=conv["parquet"], REPEATS=args.repeats)
            if tag == "10x":
                res[tag]["torchrec"] = run_step("torchrec_npy", **common)
            raw.unlink()
    one, ten = res["1x"], res["10x"]
    rate = lambda r: r["rows"] / r["seconds"]  # noqa: E731
    consume = args.consume_rate
    if consume is None:
        found = [json.loads(p.read_text()).get("samples_per_s") for p in (harness.ROOT / "runs").glob("*/summary.json")]
        consume = max((f for f in found if f), default=None)
    print(f"inputs: {rows:,} and {10 * rows:,} real Criteo rows (the shipped sample repeated)")
    print(
        f"preprocess rows/s (10x input): {rate(ten['convert']):,.0f}; pyarrow CSV read alone "
        f"{rate(ten['csv']):,.0f} -> ratio {rate(ten['convert']) / rate(ten['csv']):.2f}"
    )
    print(
        f"preprocess vs TorchRec tsv_to_npys ({10 * rows:,} rows, imports not timed): {rate(ten['convert']):,.0f} vs "
        f"{rate(ten['torchrec']):,.0f} rows/s -> ratio {rate(ten['convert']) / rate(ten['torchrec']):.1f}"
    )
    print(
        f"preprocess peak RSS: {one['convert']['peak_rss_mb']:.0f} MB (1x) vs {ten['convert']['peak_rss_mb']:.0f} MB "
        f"(10x) -> ratio {ten['convert']['peak_rss_mb'] / one['convert']['peak_rss_mb']:.2f}"
    )
    print(
        f"loader peak RSS: {one['load']['peak_rss_mb']:.0f} MB (1x) vs {ten['load']['peak_rss_mb']:.0f} MB (10x) "
        f"-> ratio {ten['load']['peak_rss_mb'] / one['load']['peak_rss_mb']:.2f}"
    )
    sp = {k: rate(v) for k, v in ten["speed"].items() if isinstance(v, dict)}
    print(
        f"loader samples/s (10x, batch 4096): shuffled {sp['shuffled']:,.0f}, in file order "
        f"{sp['ordered']:,.0f}; bare pyarrow scan {sp['scan']:,.0f} -> ratios "
        f"{sp['shuffled'] / sp['scan']:.2f} / {sp['ordered'] / sp['scan']:.2f}"
    )
    print(
        f"loader samples/s of rank 0 of 2 (10x, shuffled): reading the whole stream (global_batch) "
        f"{sp['global_batch']:,.0f}, only its own row groups (row_groups) {sp['row_groups']:,.0f} -> ratio "
        f"{sp['row_groups'] / sp['global_batch']:.2f}; row_groups vs the bare scan "
        f"{sp['row_groups'] / sp['scan']:.2f}"
    )
    if consume:
        print(
            f"loader vs the quickstart model's consumption ({consume:,.0f} samples/s): "
            f"ratio {sp['shuffled'] / consume:.1f}"
        )


if __name__ == "__main__":
    main()
