"""Training samples/s per sharding type, and pipelined vs not, at world size 2 on CPU.

The quickstart DLRM (26 tables x 10,000 rows x 16, MLPs 13-64-16 / 64-32-1) on the shipped
Criteo sample's train split, per-rank batch 256, gloo. Every configuration runs in the same
spawn of 2 ranks, one after the other; each is timed over ``--steps`` steps after
``--warmup`` steps. Ratios are against table_wise with TrainPipelineSparseDist.

    .venv/bin/python benchmarks/sharding_throughput.py [--steps 60] [--warmup 10]
"""

from __future__ import annotations

import itertools
import time

import harness
from ours import quiet

TYPES = ["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"]


def _measure(rank: int, world_size: int, steps: int, warmup: int, types: list[str]) -> dict:
    """run_ranks target: samples/s of each (sharding type, pipeline), one after the other."""
    quiet()
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.train.build import make_loaders, shard_model

    results = {}
    configs = [(t, "sparse_dist") for t in types] + [("table_wise", "base"), ("row_wise", "base")]
    for sharding_type, pipeline in configs:
        cfg = load_config(
            harness.CONFIGS / "criteo_quickstart.yaml",
            [f"sharding.sharding_types=[{sharding_type}]", "train.batch_size=256"],
        )
        job = resolve_job(cfg)
        ctx = init_distributed(job.distributed)
        loaders = make_loaders(job, ctx)
        dmp, optimizer, _ = shard_model(job, ctx)
        cls = TrainPipelineSparseDist if pipeline == "sparse_dist" else TrainPipelineBase
        pipe = cls(dmp, optimizer, ctx.device)
        batches = itertools.chain.from_iterable(itertools.repeat(list(loaders.train)))
        for _ in range(warmup):
            pipe.progress(batches)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            pipe.progress(batches)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        results[(sharding_type, pipeline)] = steps * cfg.train.batch_size * world_size / elapsed
        if hasattr(pipe, "detach"):
            pipe.detach()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, "sharding_throughput", "table_wise and row_wise only, 2 steps after 1")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    types = ["table_wise", "row_wise"] if args.smoke else TYPES
    if args.smoke:
        args.steps, args.warmup = 2, 1
    from recsys_dist.testing import run_ranks

    with harness.Results(args, argv):
        report(args, run_ranks(_measure, 2, args.steps, args.warmup, types, timeout_s=1200)[0])


def report(args, res: dict) -> None:
    """One line per configuration with its ratio to table_wise pipelined; pipelined / base."""
    base = res[("table_wise", "sparse_dist")]
    print(f"world size 2, gloo, CPU; quickstart DLRM, batch 256 per rank, {args.steps} timed steps")
    print(f"{'sharding type':<20}{'pipeline':<26}{'samples/s':>12}{'ratio':>8}")
    for (st, pipe), sps in res.items():
        name = "TrainPipelineSparseDist" if pipe == "sparse_dist" else "TrainPipelineBase"
        print(f"{st:<20}{name:<26}{sps:>12.0f}{sps / base:>8.2f}")
    for st in ("table_wise", "row_wise"):
        print(f"pipelined / base ({st}): {res[(st, 'sparse_dist')] / res[(st, 'base')]:.2f}")


if __name__ == "__main__":
    main()
