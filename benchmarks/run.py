"""Our trainer against peers and against the hardware, as one table of ratios.

    .venv/bin/python benchmarks/run.py [--quick] [--deepctr-python /tmp/dctr/bin/python] [--device auto|cpu|cuda]
    recsys-dist bench [--quick] [--model mlperf] ...     (the same, from a source checkout)

Every ratio is measured in this run: the contenders of items 1-4 run in one spawn of the
ranks, interleaved (``--reps`` rounds, in ABBA order); a ratio is the median over the rounds
of the two contenders' samples/s within the round, so load from other processes, which
drifts slowly, mostly cancels. Data: the shipped Criteo sample
(datasets/criteo_kaggle, 10,000 rows) repeated ``copies`` times and converted to Parquet by
recsys_dist (split 98/1/1 %).

1. framework overhead: our trainer end to end (Parquet -> loader -> TimedTrainPipeline,
   logging, per-epoch validation excluded from the time) vs a minimal hand-written
   TorchRec loop (DMP + TrainPipelineSparseDist) on in-memory batches of the same data; on
   CPU also at 2 ranks x batch 128 with 100,000-row tables, where per-step costs show;
2. vs a plain-PyTorch DLRM (nn.EmbeddingBag with sparse gradients, Adagrad, DDP);
3. our DeepFM vs DeepCTR-Torch's (its own venv; "skipped" with the command when absent) at
   10^4, 10^5 and 10^6 rows per table (quick: the first two);
4. TrainPipelineSparseDist vs TrainPipelineBase on our sharded model, in-memory batches;
5. samples/s and peak RSS as rows per table and batch size grow (benchmarks/growth.py);
6. the achieved fraction of memory bandwidth and of matmul FLOP/s (benchmarks/hardware.py).

On CPU: 2 gloo ranks, 1 intra-op thread each, quickstart DLRM (26 tables x 10,000 x 16),
batch 256 per rank, tables table_wise. With a CUDA device (``--device auto``): one rank
on one GPU over nccl, items 1, 4, 5, 6 only, the MLPerf DLRMv2 model (dlrm_dcnv2, dim
128) with every table capped at ``--mlperf-max-rows`` rows and one-hot ids, batch 8192,
and samples/s set against MLPerf's ~1.9M samples/s per H200. ``--model mlperf --device cpu``
runs that same path (one rank, items 1, 4, 5, 6) on CPU, at sizes set by ``--mlperf-max-rows``,
``--batch`` and ``--copies``; a test does so, since no GPU has run it (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import harness
from ours import load, quiet, trainer_epoch

DEEPCTR_VENV = (
    "python3.11 -m venv /tmp/dctr && /tmp/dctr/bin/pip install torch==2.13.0 deepctr-torch "
    "scikit-learn pyarrow requests"
)
DEFAULT_ROWS_PER_TABLE = 10_000  # the quickstart configs' data.num_embeddings
SMALL_BATCH, SMALL_ROWS = 128, 100_000  # item 1's second configuration (issue 22)
MLPERF_H200_SAMPLES_PER_S = 1.9e6  # MLPerf Training DLRM-DCNv2, per GPU of an 8 x H200 system


def deepfm_one_rank(rank: int, world: int, spec: dict) -> float:
    """run_ranks target (1 rank): best epoch samples/s of our DeepFM trainer on one rank with
    every core as intra-op threads and the global batch of the 2-rank run (on a 2-core machine
    sharding only adds all-to-alls); ``spec["rows_per_table"]`` sets the table size."""
    quiet()
    one = {**spec, "world": 1, "batch": spec["batch"] * spec["world"]}
    cfg = load(one, "deepfm")
    epoch, _ = trainer_epoch(cfg, Path(spec["tmp"]) / f"deepfm_one_rank_{spec.get('rows_per_table')}")
    return max(epoch() for _ in range(spec["reps"]))


# Item 3's table sizes (rows per table) and DeepCTR-Torch's timed rows at each: its dense
# gradient and Adagrad update touch every row every step (2.4 s a step at 10^6 rows), so
# the larger tables are timed over fewer steps.
DEEPCTR_SWEEP = {10**4: 100_000, 10**5: 20_480, 10**6: 5_120}


def deepctr_sweep(spec: dict, quick: bool, python: str) -> list[dict]:
    """Item 3: our DeepFM (one rank, every core) vs DeepCTR-Torch's at each table size of
    ``DEEPCTR_SWEEP`` (quick: the first two), same Parquet rows and ids on both sides."""
    from recsys_dist.data.resolve import prepare_from_config
    from recsys_dist.testing import run_ranks

    out = []
    for n, timed_rows in list(DEEPCTR_SWEEP.items())[: 2 if quick else 3]:
        one = {**spec, "rows_per_table": n}
        dcfg = load(one, "deepfm")
        prepared = prepare_from_config(dcfg.data)
        rows = min(prepared.rows["train"], timed_rows // 5 if quick and n == 10**4 else timed_rows)
        threads = (1, os.cpu_count() or 1) if n == 10**4 else (os.cpu_count() or 1,)
        tries = [deepctr(python, spec, dcfg, str(prepared.files["train"]), rows, t) for t in threads]
        ok = [t for t in tries if t and "samples_per_s" in t]
        theirs = max(ok, key=lambda t: t["samples_per_s"]) if ok else tries[0]
        if theirs is None or "error" in theirs:
            return [{"rows_per_table": n, "theirs": theirs}]
        ours = run_ranks(deepfm_one_rank, 1, one, timeout_s=1800)[0]
        out.append({"rows_per_table": n, "theirs": theirs, "ours": ours})
        if n == 10**4:  # where the MLP's matmuls are most of our step
            out[-1]["ours_bf16"] = run_ranks(deepfm_one_rank, 1, {**one, "precision": "bf16-mixed"}, timeout_s=1800)[0]
    import torch
    from baselines import mlp_alone

    m = load(spec, "deepfm").model
    torch.set_num_threads(os.cpu_count() or 1)
    width = 26 * m.embedding_dim + 13
    out[0]["mlp_alone"] = mlp_alone(width, m.deep_layer_sizes, spec["batch"] * spec["world"])
    out[0]["mlp_alone_bf16"] = mlp_alone(width, m.deep_layer_sizes, spec["batch"] * spec["world"], bf16=True)
    out[0]["mlp_shape"] = [width, *m.deep_layer_sizes, 1]
    return out


def measure(rank: int, world: int, spec: dict) -> dict:
    """run_ranks target: items 1-4 and 6's measurements, interleaved over ``reps`` rounds."""
    quiet()
    import baselines
    import hardware
    import torch
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    from recsys_dist.config.job import resolve_job
    from recsys_dist.data.resolve import prepare_from_config
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.train.build import shard_model

    name = spec["model"]
    cfg = load(spec, name)
    job = resolve_job(cfg)
    ctx = init_distributed(job.distributed)
    dev, B, m = ctx.device, spec["batch"], cfg.model
    train_path = str(prepare_from_config(job.data, fmt=job.fmt).files["train"])
    dense, sparse = job.features.dense_names, job.features.keys
    sizes = job.table_sizes
    lr = cfg.train.embedding_lr
    run = {}
    ours, steps, trainer = trainer_epoch(cfg, Path(spec["tmp"]) / name, with_trainer=True)
    run["ours"] = ours
    batches = baselines.memory_batches(train_path, rank, world, B, dense, sparse, steps)

    def rate(step, warmup: int = 3):
        for _ in range(warmup):
            step()
        return lambda: steps * B * world / baselines.timed_steps(step, steps)

    dcn = (m.dcn_num_layers, m.dcn_low_rank_dim) if m.name == "dlrm_dcnv2" else None
    sharding = None if name == "mlperf" else "table_wise"
    run["handwritten"] = rate(
        baselines.handwritten_torchrec(
            batches,
            sizes,
            m.embedding_dim,
            m.dense_arch_layer_sizes,
            m.over_arch_layer_sizes,
            sharding,
            lr,
            dev,
            dcn,
            exact_adagrad=cfg.train.embedding_optimizer == "exact_adagrad",
        )
    )
    if name == "dlrm" and spec.get("small"):
        # Item 1 again at a small per-rank batch and larger tables, where per-step costs show.
        small = {**spec, **spec["small"]}
        scfg = load(small, name)
        run["ours_small"], ssteps = trainer_epoch(scfg, Path(spec["tmp"]) / "small")
        spath = str(prepare_from_config(scfg.data).files["train"])  # ids hashed into the larger tables
        sbatches = baselines.memory_batches(spath, rank, world, small["batch"], dense, sparse, ssteps)
        step = baselines.handwritten_torchrec(
            sbatches,
            resolve_job(scfg).table_sizes,
            m.embedding_dim,
            m.dense_arch_layer_sizes,
            m.over_arch_layer_sizes,
            sharding,
            lr,
            dev,
        )
        for _ in range(3):
            step()
        run["handwritten_small"] = lambda: ssteps * small["batch"] * world / baselines.timed_steps(step, ssteps)
    if name == "dlrm":
        run["plain"] = rate(
            baselines.plain_pytorch(
                batches, sizes, m.embedding_dim, m.dense_arch_layer_sizes, m.over_arch_layer_sizes, lr
            )
        )
        if spec["deepfm"]:
            run["ours_deepfm"], _ = trainer_epoch(load(spec, "deepfm"), Path(spec["tmp"]) / "deepfm")
    from recsys_dist.data.loader import CTRBatch

    ours_batches = [
        CTRBatch(
            dense_features=b.dense_features,
            sparse_features=b.sparse_features,
            labels=b.labels,
            weights=torch.ones_like(b.labels),
        )
        for b in batches
    ]
    for kind, cls in (("sparse_dist", TrainPipelineSparseDist), ("base", TrainPipelineBase)):
        dmp, opt, _ = shard_model(job, ctx)
        run[f"pipe_{kind}"] = rate(baselines.pipeline_stepper(cls(dmp, opt, dev), ours_batches))
    res = harness.abba(run, spec["reps"])  # ABBA: drift in the load cancels out
    out = {"rounds": res, "median": {k: harness.median(v) for k, v in res.items()}}
    out["steps"] = steps
    out["prefetch"] = trainer.loaders.train.prefetch  # data.prefetch as resolved (null: auto)
    # Item 6: every rank at once, as while training; summed over the ranks.
    dist.barrier()
    bw = hardware.copy_bandwidth(dev)
    dist.barrier()
    mm = hardware.mm_flops(hardware.linear_shapes(cfg), B, dev)
    hw = torch.tensor([bw, mm], dtype=torch.float64, device=dev)
    dist.all_reduce(hw)
    out["copy_bytes_per_s"], out["mm_flops"] = float(hw[0]), float(hw[1])
    out["threads"] = torch.get_num_threads()
    return out


def deepctr(python: str | None, spec: dict, cfg, train_path: str, rows: int, threads: int) -> dict | None:
    from baselines import DEEPCTR_WORKER

    from recsys_dist.config.job import resolve_job

    if python is None:
        return None
    resolved = resolve_job(cfg)
    job = {
        "train": train_path,
        "dense": resolved.features.dense_names,
        "sparse": resolved.features.keys,
        "sizes": resolved.table_sizes,
        "dim": cfg.model.embedding_dim,
        "deep": cfg.model.deep_layer_sizes,
        "batch": spec["batch"] * spec["world"],
        "rows": rows,
        "threads": threads,
    }
    try:
        out = harness.python(DEEPCTR_WORKER, json.dumps(job), executable=python)
    except RuntimeError as err:
        return {"error": (str(err).strip().splitlines() or ["?"])[-1]}
    return {**harness.last_json(out), "threads": threads}


def main(argv: list[str] | None = None) -> int:
    from recsys_dist.cli.main import positive_int, python_command

    parser = harness.parser(
        __doc__, "bench", "--quick, 1 round, the first 2,000 rows of the sample once, batch 64, items 3 and 5 skipped"
    )
    parser.add_argument("--quick", action="store_true", help="smaller data and sweeps: under 3 minutes on 2 cores")
    parser.add_argument(
        "--deepctr-python",
        type=python_command,
        help="python of a venv with deepctr-torch, a path or a command on PATH (item 3; skipped when not given)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--reps", type=positive_int, default=None, help="interleaved rounds (default 3 quick, 5 full)")
    parser.add_argument(
        "--model",
        choices=["auto", "dlrm", "mlperf"],
        default="auto",
        help="dlrm: the quickstart DLRM, 2 ranks, items 1-6; mlperf: the MLPerf DLRMv2 model with "
        "capped tables, one rank, items 1, 4, 5, 6; auto: mlperf on CUDA, dlrm on CPU",
    )
    parser.add_argument("--mlperf-max-rows", type=positive_int, default=1_000_000, help="rows cap of each MLPerf table")
    parser.add_argument(
        "--batch", type=positive_int, default=None, help="per-rank batch (default 8192 on CUDA, 256 on CPU)"
    )
    parser.add_argument(
        "--copies",
        type=positive_int,
        default=None,
        help="times the Criteo sample is repeated (default 5 quick / 20 full; CUDA 20 / 100)",
    )
    parser.add_argument(
        "--rows", type=positive_int, default=None, help="use only the first N rows of the Criteo sample (tests)"
    )
    parser.add_argument("--skip", default="", help="comma-separated items to skip: 3,5")
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if not skip <= set("123456"):
        parser.error(f"--skip: comma-separated item numbers 1-6, e.g. 3,5; got {args.skip!r}")
    if args.smoke:
        args.quick, args.reps, args.copies = True, 1, 1
        args.rows, args.batch, skip = args.rows or 2000, args.batch or 64, skip | {"3", "5"}
    quiet()
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    with harness.Results(args, argv):
        run(args, skip, cuda)
    return 0


def run(args, skip: set[str], cuda: bool) -> None:
    """Items 1-6 as ``args`` say (module doc); prints the table."""
    import growth

    from recsys_dist.data.resolve import prepare_from_config
    from recsys_dist.testing import run_ranks

    quick = args.quick
    started = time.perf_counter()
    model = args.model if args.model != "auto" else ("mlperf" if cuda else "dlrm")
    # The MLPerf model runs on one rank (one GPU); on CPU that mirrors the GPU run at small scale.
    world = 1 if cuda or model == "mlperf" else 2
    copies = args.copies or ((20 if quick else 100) if cuda else (5 if quick else 20))
    spec = {
        "world": world,
        "batch": args.batch or (8192 if cuda else 256),
        "reps": args.reps or (3 if quick else 5),
        "device": "cuda" if cuda else "cpu",
        "model": model,
        "max_rows": args.mlperf_max_rows,
        "deepfm": model == "dlrm" and "3" not in skip,
        # Item 1's second line (CPU DLRM, 2 ranks): a small per-rank batch and 10^5-row tables.
        "small": {"batch": SMALL_BATCH, "rows_per_table": SMALL_ROWS} if model == "dlrm" and world == 2 else None,
    }
    with tempfile.TemporaryDirectory() as tmp:
        raw = harness.criteo_sample(Path(tmp) / "criteo_repeated.txt", copies, args.rows)
        spec.update(raw=str(raw), cache=str(Path(tmp) / "cache"), tmp=tmp)
        cfg = load(spec, spec["model"])
        prepared = prepare_from_config(cfg.data)
        train_rows = prepared.rows["train"]
        theirs = deepctr_sweep(spec, quick, args.deepctr_python) if spec["deepfm"] else None
        res = run_ranks(measure, world, spec, timeout_s=1800, backend="nccl" if cuda else "gloo")[0]
        grow = None
        if "5" not in skip:
            rows_list = [10**4, 10**5, 10**6] + ([] if quick else [10**7])
            batch_list = [256, 1024, 4096] + ([] if quick else [16384])
            if cuda:
                batch_list = [1024, 4096, 16384, 65536]
            grow = run_ranks(
                growth.sweep,
                1,
                rows_list,
                batch_list,
                10**5,
                4096 if cuda else 256,
                0.5 if quick else 2.0,
                model == "mlperf",
                spec["device"],
                timeout_s=1800,
                backend="nccl" if cuda else "gloo",
            )[0]
    print_table(spec, cfg, res, theirs, grow, train_rows, copies, args)
    print(f"\n(benchmark wall time {time.perf_counter() - started:.0f} s)")


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def print_table(spec, cfg, res, theirs, grow, train_rows, copies, args) -> None:
    import growth
    import hardware
    import torch

    B, W, dev = spec["batch"], spec["world"], spec["device"]
    m = cfg.model
    where = f"{W} rank(s) on {dev}" + (
        f", gloo, {res['threads']} intra-op thread(s) per rank"
        if dev == "cpu"
        else f" ({torch.cuda.get_device_name(0)}), nccl"
    )
    n = cfg.data.num_embeddings
    rows = f"{n:,} rows" if isinstance(n, int) else f"MLPerf's rows capped at {spec['max_rows']:,}"
    model = (
        f"{m.name}: 26 tables x {rows} x dim {m.embedding_dim}, MLPs {m.dense_arch_layer_sizes} / "
        f"{m.over_arch_layer_sizes}, {cfg.train.embedding_optimizer} fused + {cfg.train.dense_optimizer}"
    )
    data = f"Criteo sample x{copies} -> {train_rows:,} train rows (Parquet), batch {B} per rank ({B * W} global)"
    print(
        f"setup: {where}; {model}; {data}; {spec['reps']} ABBA-interleaved rounds of {res['steps']} steps, "
        f"medians of the rounds; torch {torch.__version__}"
    )
    rows = []

    rounds, med = res["rounds"], res["median"]

    def within(a: str, b: str) -> float:
        return harness.paired_ratio(rounds[a], rounds[b])

    def spread(a: str, b: str) -> str:
        ratios = harness.paired_ratios(rounds[a], rounds[b])
        return f"; rounds {min(ratios):.2f}-{max(ratios):.2f}"

    def line(item, what, config, a, b, unit, aim=None, ratio=None):
        ratio = ratio if ratio is not None else (a / b if b else float("nan"))
        verdict = "" if aim is None else (" met" if ratio >= aim else " not met")
        rows.append(
            (
                item,
                what,
                config,
                f"**{ratio:.2f}**" if ratio >= 0.1 else f"**{ratio:.4f}**",
                f"{_fmt(a)} vs {_fmt(b)} {unit}",
                "" if aim is None else f">= {aim}{verdict}",
            )
        )

    tables = "table_wise" if spec["model"] == "dlrm" else "the planner's sharding, tables' fused optimizer alike"
    line(
        "1",
        "framework overhead",
        f"our trainer end to end from Parquet (shuffled, data.prefetch {res.get('prefetch', '?')}, logging) vs "
        f"hand-written DMP + TrainPipelineSparseDist on in-memory batches; same model, {tables}",
        med["ours"],
        med["handwritten"],
        "samples/s" + spread("ours", "handwritten"),
        0.95,
        within("ours", "handwritten"),
    )
    if "ours_small" in med:
        small = spec["small"]
        line(
            "1",
            f"framework overhead, batch {small['batch']}, {small['rows_per_table']:,} rows",
            f"as above at {W} ranks x batch {small['batch']} ({small['batch'] * W} global), 26 tables x "
            f"{small['rows_per_table']:,} rows: per-step costs weigh most at small batches",
            med["ours_small"],
            med["handwritten_small"],
            "samples/s" + spread("ours_small", "handwritten_small"),
            0.95,
            within("ours_small", "handwritten_small"),
        )
    if "plain" in med:
        line(
            "2",
            "vs plain PyTorch",
            "our trainer vs DLRM of 26 nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad, "
            "DDP (sparse gradients all-gathered by a comm hook: gloo's sparse all-reduce corrupts the heap), in-memory batches",
            med["ours"],
            med["plain"],
            "samples/s",
            1.5,
            within("ours", "plain"),
        )
    if "ours_deepfm" in med:
        if not theirs or theirs[0]["theirs"] is None:
            rows.append(
                (
                    "3",
                    "vs DeepCTR-Torch",
                    f"skipped: no --deepctr-python given; make a venv with: {DEEPCTR_VENV}",
                    "",
                    "",
                    ">= 5",
                )
            )
        elif "error" in theirs[0]["theirs"]:
            rows.append(
                ("3", "vs DeepCTR-Torch", f"DeepCTR-Torch failed: {theirs[0]['theirs']['error']}", "", "", ">= 5")
            )
        for point in theirs or []:
            if "ours" not in point:
                continue
            n, them = point["rows_per_table"], point["theirs"]
            note = (
                f"; our 2-rank x {B} run: {_fmt(max(rounds['ours_deepfm']))} samples/s"
                if n == DEFAULT_ROWS_PER_TABLE
                else ""
            )
            line(
                "3",
                f"vs DeepCTR-Torch DeepFM, 10^{round(math.log10(n))} rows per table",
                f"26 tables x {n:,} rows (+ 26 first-order tables), dim 16, deep 256-128, batch {B * W}: our deepfm "
                f"trainer on 1 rank, {os.cpu_count()} threads, best epoch{note} vs DeepCTR-Torch 0.3 DeepFM.fit, "
                f"1 process, {them['threads']} thread{'s' if them['threads'] != 1 else ''}, {them['rows']:,} rows, dense Adagrad; same Parquet rows; "
                "not interleaved",
                point["ours"],
                them["samples_per_s"],
                "samples/s",
                5,
            )
            if "mlp_alone" in point:
                line(
                    "3",
                    "ceiling at 10^4 rows",
                    f"the deep MLP alone ({'-'.join(map(str, point['mlp_shape']))}, "
                    f"fwd + bwd + Adagrad, batch {B * W}, {os.cpu_count()} threads): the most any float32 DeepFM "
                    "can reach here, vs DeepCTR-Torch",
                    point["mlp_alone"],
                    them["samples_per_s"],
                    "samples/s",
                )
            if "ours_bf16" in point:
                line(
                    "3",
                    "bf16-mixed vs DeepCTR-Torch, 10^4 rows per table",
                    "as the 10^4 line, ours with train.precision=bf16-mixed (the MLP's matmuls in bfloat16 "
                    "autocast, weights and optimizer float32) vs DeepCTR-Torch in float32 (it has no mixed "
                    "precision)",
                    point["ours_bf16"],
                    them["samples_per_s"],
                    "samples/s",
                    5,
                )
                line(
                    "3",
                    "bf16-mixed ceiling at 10^4 rows",
                    "the deep MLP alone as above, under bfloat16 autocast, vs DeepCTR-Torch",
                    point["mlp_alone_bf16"],
                    them["samples_per_s"],
                    "samples/s",
                )
    line(
        "4",
        "pipelining",
        f"TrainPipelineSparseDist / TrainPipelineBase, our sharded model, world size {W}, in-memory batches",
        med["pipe_sparse_dist"],
        med["pipe_base"],
        "samples/s",
        None,
        within("pipe_sparse_dist", "pipe_base"),
    )
    if grow:
        r, b = grow["rows"], grow["batch"]
        for key, pts, xs in (("rows", r, [p["rows"] for p in r]), ("batch", b, [p["batch"] for p in b])):
            # Memory added by the model and its batches: peak RSS over the RSS before the sweep's first point.
            inc = lambda p, pts=pts: max(p["peak_rss_mb"] - pts[0]["base_rss_mb"], 1e-3)  # noqa: E731
            k_sps = harness.fit_exponent(xs, [p["samples_per_s"] for p in pts])
            k_mem = harness.fit_exponent(xs, [inc(p) for p in pts])
            k_last = harness.fit_exponent(xs[-2:], [inc(p) for p in pts[-2:]])
            first, last = pts[0], pts[-1]
            what = (
                f"rows per table {xs[0]:.0e} -> {xs[-1]:.0e}, batch {first['batch']}"
                if key == "rows"
                else f"batch {xs[0]} -> {xs[-1]}, {first['rows']:.0e} rows per table"
            )
            dense = "dim 128, MLPerf's dense part" if spec["model"] == "mlperf" else "dim 16, the quickstart's MLPs"
            rows.append(
                (
                    "5",
                    f"growth: {key}",
                    f"{what}; {growth.TABLES} tables x {dense}, row-wise Adagrad, 1 rank, synthetic uniform ids",
                    f"**{last['samples_per_s'] / first['samples_per_s']:.2f}** samples/s, "
                    f"**{inc(last) / inc(first):.1f}** RSS",
                    f"fitted: samples/s ~ x^{k_sps:.2f}; peak RSS above the pre-sweep RSS ~ x^{k_mem:.2f} "
                    f"(last step x^{k_last:.2f})",
                    "",
                )
            )
    bps, fps = hardware.embedding_bytes_per_sample(cfg), hardware.flops_per_sample(cfg)
    sps = med["ours"]
    line(
        "6",
        "memory bandwidth",
        f"our trainer x {bps:,} B/sample (embedding rows read 4D + read/write 8D, optimizer "
        f"state, pooled 8D; D={m.embedding_dim}) vs {W} rank(s) copying 256 MB fp32 at once (bytes read + written)",
        sps * bps / 1e9,
        res["copy_bytes_per_s"] / 1e9,
        "GB/s",
    )
    line(
        "6",
        "matmul FLOP/s",
        f"our trainer x {fps:,} FLOP/sample (MLPs + interaction, fwd+bwd = 3x fwd) vs "
        f"torch.mm at the model's Linear shapes, batch {B}, {W} rank(s) at once",
        sps * fps / 1e9,
        res["mm_flops"] / 1e9,
        "GFLOP/s",
    )
    if dev == "cuda":
        line(
            "GPU",
            "vs MLPerf",
            "our trainer's samples/s on one GPU vs MLPerf DLRM-DCNv2 per H200 (multi-hot, "
            "full tables: not the same work)",
            sps,
            MLPERF_H200_SAMPLES_PER_S,
            "samples/s",
        )
    print("\n| # | measure | configuration | ratio | measured | aim |\n| --- | --- | --- | ---: | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if grow:
        print(
            "\ngrowth curves (item 5): rows per table, batch, samples/s, peak RSS MB, baseline RSS MB, "
            "tables + optimizer state MB"
        )
        for p in grow["rows"] + grow["batch"]:
            print(
                f"  {p['rows']:>10,} {p['batch']:>7,} {p['samples_per_s']:>12,.0f} {p['peak_rss_mb']:>9,.0f} "
                f"{p['base_rss_mb']:>9,.0f} {p['table_mb']:>9,.0f}"
                + (f"  GPU peak {p['peak_gpu_mb']:,.0f} MB" if "peak_gpu_mb" in p else "")
            )
    print(
        "\nrounds (samples/s per round): "
        + "; ".join(f"{k} " + "/".join(_fmt(x) for x in v) for k, v in rounds.items())
    )


if __name__ == "__main__":
    sys.exit(main())
