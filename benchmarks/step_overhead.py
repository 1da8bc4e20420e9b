"""Per-step overhead of our trainer against the hand-written TorchRec loop, at small per-rank batches.

    .venv/bin/python benchmarks/step_overhead.py [--batch 128] [--rows 100000] [--copies 20]
        [--reps 6] [--world 2] [--profile DIR] [--pool-ab] [--stages] [--set data.prefetch=0 ...]

In one spawn of ``--world`` gloo ranks (1 intra-op thread each), interleaved in ABBA order over
``--reps`` rounds, one epoch each (``--prefetch-ab N`` adds ``ours_pN``: ours with
``data.prefetch=N``, the same Trainer, to A/B the loader's background threads in one run;
``--pool-ab`` adds ``ours_mimalloc``: ours with its Parquet windows decoded into pyarrow's
default pool, see ``recsys_dist/data/parquet_io.py``):

- ``ours``: our Trainer end to end (Parquet -> loader -> pipeline, logging; validation excluded
  from the time, as ``benchmarks/run.py`` item 1);
- ``pipe``: our sharded model in a plain ``TrainPipelineSparseDist`` on in-memory batches
  (what the model costs, without loader or trainer loop);
- ``hand``: the hand-written DMP + TrainPipelineSparseDist loop of ``benchmarks/baselines.py``
  on in-memory batches.

Prints samples/s per round, the medians, and the paired ratios ours/hand, pipe/hand. With
``--profile DIR``: one extra epoch of ``ours`` and of ``hand`` under cProfile per rank, written
to ``DIR/{ours,hand}_rank{r}.prof`` (after the timed rounds, so they do not disturb them).
With ``--stages``: each contender's seconds per epoch in TorchRec's pipeline stages and in our
loader's window reads (``read_cpu``: the CPU of the whole process meanwhile), medians per rank.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
from ours import overrides, quiet, trainer_epoch


def swapped_loader(trainer, path: str, epoch):
    """``epoch`` run with the train loader built by the ``ParquetBatchLoader`` of ``path``."""
    mod = harness.load_file(Path(path), "baseline_loader")
    ours = trainer.loaders.train
    theirs = mod.ParquetBatchLoader(
        ours.files,
        ours.batch_size,
        ours.rank,
        ours.world_size,
        ours.dense_names,
        ours.keys,
        shuffle=ours.shuffle,
        seed=ours.seed,
        remainder=ours.remainder,
        num_embeddings=ours.num_embeddings,
        shuffle_buffer_rows=ours.buffer_rows,
        prefetch=ours.prefetch,
        pin_memory=ours.pin_memory,
        rank_reads=ours.rank_reads,
    )

    return with_loader(trainer, ours, ours.prefetch, epoch), with_loader(trainer, theirs, ours.prefetch, epoch)


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, grouped: ``train`` (the calling thread),
    ``loader`` (Python threads named recsys_dist-*), ``other`` (gloo's, pyarrow's and every
    other thread; ``gloo``: the part of ``other`` in gloo's threads). Linux /proc; empty elsewhere. A thread that ends between two calls drops out
    of the difference (our loader's threads, opened during the previous epoch's validation and
    done with the epoch): the process total (``CPU ms/step``) still counts it."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    me = threading.get_native_id()
    tick = os.sysconf("SC_CLK_TCK")
    out = {"train": 0.0, "loader": 0.0, "other": 0.0, "gloo": 0.0}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                comm, fields = f.read().split(" (", 1)[1].rsplit(")", 1)
                fields = fields.split()
        except (OSError, IndexError):  # the thread ended
            continue
        secs = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        name = names.get(int(tid), "")
        group = "train" if int(tid) == me else "loader" if name.startswith("recsys_dist-") else "other"
        out[group] += secs
        if group == "other" and "gloo" in comm:
            out["gloo"] += secs
    return out


def with_loader(trainer, loader, prefetch: int, epoch):
    """``epoch`` run with ``loader`` as the train loader, its ``data.prefetch`` set to ``prefetch``.

    The next epoch's batches are opened during the last epoch's validation, by whichever loader
    and setting ran then (and iter_from decides its threads when it opens): each contender
    opens its own here, just before its epoch, so none runs on another's iterator."""

    def run() -> float:
        saved, before = loader.prefetch, trainer.loaders.train
        trainer.loaders.train, loader.prefetch = loader, prefetch
        early = trainer._source.early_batches
        if early is not None:
            early.close()
            loader.set_epoch(trainer._source.next_epoch)
            trainer._source.early_batches = loader.iter_from(0)
        try:
            return epoch()
        finally:
            trainer.loaders.train, loader.prefetch = before, saved

    return run


def with_env(name: str, value: str, epoch):
    """``epoch`` run with the environment variable ``name`` set to ``value`` (restored after)."""

    def run() -> float:
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            return epoch()
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved

    return run


# What ``--stages`` times in every contender's epoch: TorchRec's pipeline stages and our
# loader's window read (``read``; ``read_cpu``: the CPU of every thread of the process meanwhile).
STAGES = (
    "progress",
    "fill_pipeline",
    "_next_batch",
    "start_sparse_data_dist",
    "wait_sparse_data_dist",
    "_backward",
    "_optimizer_step",
)


def stage_clock() -> dict[str, float]:
    """Wrap the :data:`STAGES` and the loader's ``_read`` with accumulators (seconds); returns them."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recsys_dist.data.loader import ParquetBatchLoader

    acc: dict[str, float] = {}

    def wrap(cls, name: str, key: str, cpu: bool = False) -> None:
        inner = getattr(cls, name)

        def timed(*args, **kwargs):
            t, c = time.perf_counter(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
                if cpu:
                    acc[key + "_cpu"] = acc.get(key + "_cpu", 0.0) + time.process_time() - c

        setattr(cls, name, timed)

    for name in STAGES:
        wrap(TrainPipelineSparseDist, name, name.strip("_"))
    wrap(ParquetBatchLoader, "_read", "read", cpu=True)
    return acc


def measure(rank: int, world: int, spec: dict) -> dict:
    """run_ranks target: the three contenders, interleaved."""
    quiet()
    import cProfile

    import baselines
    import torch
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.data.loader import CTRBatch
    from recsys_dist.data.resolve import prepare_from_config
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.train.build import shard_model

    cfg = load_config(harness.CONFIGS / "criteo_quickstart.yaml", spec["overrides"])
    job = resolve_job(cfg)
    ctx = init_distributed(job.distributed)
    dev, B, m = ctx.device, spec["batch"], cfg.model
    train_path = str(prepare_from_config(job.data, fmt=job.fmt).files["train"])
    dense, sparse = job.features.dense_names, job.features.keys
    ours, steps, trainer = trainer_epoch(cfg, Path(spec["tmp"]) / "ours", with_trainer=True)
    batches = baselines.memory_batches(train_path, rank, world, B, dense, sparse, steps)
    lr = cfg.train.embedding_lr
    hand_step = baselines.handwritten_torchrec(
        batches,
        job.table_sizes,
        m.embedding_dim,
        m.dense_arch_layer_sizes,
        m.over_arch_layer_sizes,
        "table_wise",
        lr,
        dev,
    )
    dmp, opt, _ = shard_model(job, ctx)
    ours_batches = [CTRBatch(b.dense_features, b.sparse_features, b.labels, torch.ones_like(b.labels)) for b in batches]
    pipe_step = baselines.pipeline_stepper(TrainPipelineSparseDist(dmp, opt, dev), ours_batches)
    for _ in range(3):
        hand_step()
        pipe_step()

    def rate(step):
        return lambda: steps * B * world / baselines.timed_steps(step, steps)

    run = {"ours": ours, "pipe": rate(pipe_step), "hand": rate(hand_step)}
    if spec.get("prefetch_ab") is not None:  # ours again, with another data.prefetch
        train = trainer.loaders.train
        run["ours"] = with_loader(trainer, train, train.prefetch, ours)
        run[f"ours_p{spec['prefetch_ab']}"] = with_loader(trainer, train, spec["prefetch_ab"], ours)
    if spec.get("baseline_loader"):  # ours again, with the train loader of another checkout
        run["ours"], run["ours_base"] = swapped_loader(trainer, spec["baseline_loader"], ours)
    if spec.get("pool_ab"):  # ours again, its windows decoded into pyarrow's default pool
        train = trainer.loaders.train
        run["ours"] = with_loader(trainer, train, train.prefetch, ours)
        run["ours_mimalloc"] = with_env(
            "ARROW_DEFAULT_MEMORY_POOL", "mimalloc", with_loader(trainer, train, train.prefetch, ours)
        )
    acc = stage_clock() if spec.get("stages") else None

    def measured(epoch):
        """``epoch`` and what this rank spent on it: samples/s, CPU ms and context switches per
        step (every thread of the process), CPU ms per step by thread group, --stages seconds."""

        def run_round() -> dict:
            c0, u0, t0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
            if acc is not None:
                acc.clear()
            rate = epoch()
            u1, t1 = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
            return {
                "rate": rate,
                "stages": dict(acc) if acc is not None else None,
                "threads": {g: (t1[g] - t0.get(g, 0.0)) * 1e3 / steps for g in t1},
                "cpu": (time.process_time() - c0) * 1e3 / steps,
                "switches": (u1.ru_nvcsw + u1.ru_nivcsw - u0.ru_nvcsw - u0.ru_nivcsw) / steps,
            }

        return run_round

    got = harness.abba({k: measured(f) for k, f in run.items()}, spec["reps"])
    res = {k: [x["rate"] for x in v] for k, v in got.items()}
    cpu, switches, threads = (
        {k: [x[what] for x in v] for k, v in got.items()} for what in ("cpu", "switches", "threads")
    )
    stages = {k: [x["stages"] for x in v if x["stages"] is not None] for k, v in got.items()}
    every = [None] * world
    dist.all_gather_object(every, {"cpu": cpu, "switches": switches, "threads": threads, "stages": stages})
    if spec.get("profile"):
        out = Path(spec["profile"])
        out.mkdir(parents=True, exist_ok=True)
        for k in ("ours", "hand"):
            prof = cProfile.Profile()
            prof.enable()
            run[k]()
            prof.disable()
            prof.dump_stats(str(out / f"{k}_rank{rank}.prof"))
    return {"rounds": res, "cpu_ms": every, "steps": steps, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "step_overhead", "batch 256, 1,000-row tables, the sample once, 2 rounds")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rows", type=int, default=100_000, help="rows per table")
    p.add_argument("--copies", type=int, default=20, help="times the Criteo sample is repeated")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--profile", default=None, help="directory for cProfile dumps per rank")
    p.add_argument("--baseline-loader", default=None, help="loader.py of another checkout: ours with it too")
    p.add_argument("--prefetch-ab", type=int, default=None, help="ours also with this data.prefetch (ours_pN)")
    p.add_argument("--pool-ab", action="store_true", help="ours also with windows decoded into pyarrow's default pool")
    p.add_argument("--stages", action="store_true", help="seconds per epoch by pipeline stage and loader read")
    p.add_argument("--set", action="append", default=[], help="extra config override for our trainer")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.rows, args.copies, args.reps = 256, 1000, 1, 2
    from recsys_dist.testing import run_ranks

    with harness.Results(args, argv):
        with tempfile.TemporaryDirectory() as tmp:
            spec = {
                "raw": str(harness.criteo_sample(Path(tmp) / "criteo_repeated.txt", args.copies)),
                "cache": str(Path(tmp) / "cache"),
                "tmp": tmp,
                "batch": args.batch,
                "reps": args.reps,
                "world": args.world,
                "device": "cpu",
                "rows_per_table": args.rows,
                "profile": args.profile,
                "baseline_loader": args.baseline_loader,
                "prefetch_ab": args.prefetch_ab,
                "pool_ab": args.pool_ab,
                "stages": args.stages,
            }
            spec["overrides"] = overrides(spec, "dlrm") + [f"train.epochs={2 * args.reps + 3}", *args.set]
            res = run_ranks(measure, args.world, spec, timeout_s=3600)[0]
        report(args, res)
    return 0


def report(args, res: dict) -> None:
    """Print the rounds, medians, per-rank CPU, context switches, stages and paired ratios."""
    rounds = res["rounds"]
    med = {k: harness.median(v) for k, v in rounds.items()}

    def within(a: str, b: str) -> float:
        return harness.paired_ratio(rounds[a], rounds[b])

    print(
        f"{args.world} ranks x batch {args.batch}, 26 tables x {args.rows:,} x 16, {res['steps']} steps/epoch, "
        f"{res['threads']} thread(s)/rank, {args.reps} ABBA rounds; load {os.getloadavg()[0]:.2f}"
    )
    for k, v in rounds.items():
        print(f"  {k:5s} median {med[k]:>9,.0f}  rounds " + " / ".join(f"{x:,.0f}" for x in v))
    for r, c in enumerate(res["cpu_ms"]):
        for what in ("cpu", "switches"):
            unit = "CPU ms/step" if what == "cpu" else "context switches/step"
            print(
                f"  rank {r} {unit} (median): "
                + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in c[what].items())
            )
    for r, c in enumerate(res["cpu_ms"]):
        print(
            f"  rank {r} CPU ms/step by thread (median; train / loader / other incl. gloo / of which gloo): "
            + ", ".join(
                f"{k} "
                + " / ".join(f"{statistics.median(t[g] for t in v):.2f}" for g in ("train", "loader", "other", "gloo"))
                for k, v in c["threads"].items()
                if v and v[0]
            )
        )
    for r, c in enumerate(res["cpu_ms"]):
        for k, v in c["stages"].items():
            if v:
                keys = sorted({key for epoch in v for key in epoch})
                print(
                    f"  rank {r} {k} s/epoch (median): "
                    + ", ".join(f"{key} {statistics.median(e.get(key, 0.0) for e in v):.3f}" for key in keys)
                )
    print(f"  ours/hand {within('ours', 'hand'):.3f}   pipe/hand {within('pipe', 'hand'):.3f}")
    print(
        f"  95% bootstrap intervals of the paired ratios (rounds resampled): ours/hand "
        f"{harness.ratio_interval(rounds['ours'], rounds['hand'])}, pipe/hand {harness.ratio_interval(rounds['pipe'], rounds['hand'])}"
    )
    for k in rounds:
        if k.startswith("ours_p"):
            print(f"  {k}/hand {within(k, 'hand'):.3f}   {k}/ours {within(k, 'ours'):.3f}")
    if "ours_mimalloc" in rounds:
        print(
            f"  ours_mimalloc/hand {within('ours_mimalloc', 'hand'):.3f}   ours/ours_mimalloc {within('ours', 'ours_mimalloc'):.3f}"
        )
    if "ours_base" in rounds:
        print(f"  ours_base/hand {within('ours_base', 'hand'):.3f}   ours/ours_base {within('ours', 'ours_base'):.3f}")
    print(json.dumps({"median": med, "ours/hand": within("ours", "hand"), "pipe/hand": within("pipe", "hand")}))


if __name__ == "__main__":
    sys.exit(main())
