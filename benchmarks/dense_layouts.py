"""The dense tower's layouts on MLPerf DLRMv2's dense sizes: ``distributed.dense.strategy`` ddp,
fsdp and pipeline (2 stages, 1f1b, 4 microbatches), peak memory per rank and samples/s.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/dense_layouts.py [--world-sizes 2 4]
        [--towers dlrmv2 over4x] [--rounds 3] [--steps 20] [--batch 128] [--record]

Each run trains configs/criteo_dlrmv2.yaml (the shipped Criteo sample; bottom MLP 512-256-128,
3 low-rank cross layers of rank 512 over 27 x 128 columns, dense Adagrad) for ``--steps`` steps of
``--batch`` rows per rank, one intra-op thread per rank, no checkpoints. Towers: ``dlrmv2``
(over-arch 1024-1024-512-256-1, as shipped) and ``over4x`` (over-arch 3072-2048-2048-512-1,
~4x its parameters). A run is a fresh process that starts the ranks (``recsys_dist.testing.run_ranks``)
and runs ``Trainer.fit`` with a callback; per world size and tower the layouts run ``--rounds``
rounds in ABBA order (``harness.abba``), so load from other processes weighs on each alike.

Per run and rank:

- **dense bytes** (exact, from the tensors at the last step's end, the tower only): the rank's
  parameters (its local shard under fsdp), the gradients it holds then, and the dense
  optimizer's state (``recsys_dist.distributed.dense.local_dense_bytes``, ``optimizer_state_bytes``).
- **peak RSS growth** (MiB): the largest resident set, sampled every 5 ms by a thread from the
  rank's start to its last training step's end, less the resident set at its start (torch and
  recsys_dist imported, nothing built). It holds everything the rank builds and touches: the
  tables and their optimizer state (the same under every layout), the data, the tower,
  gradients, optimizer state, activations, communication buffers and what the allocator keeps.

samples/s: the run's training rate after its first logged window (``harness.steady_rate``, log
every 5 steps), global rows. Ratios are within a round (same load), medians over rounds.

``--layouts`` picks among them; ``--before DIR`` adds ``pipeline, before``: the pipeline layout
run by the ``recsys_dist`` of the checkout DIR (e.g. ``git archive <commit> | tar -x -C DIR``, the
code before a change), interleaved with the others in the same rounds.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

import harness

CONFIG = harness.CONFIGS / "criteo_dlrmv2.yaml"
LAYOUTS = {
    "ddp": [],
    "fsdp": ["distributed.dense.strategy=fsdp"],
    "pipeline": [
        "distributed.dense.strategy=pipeline",
        "distributed.dense.stages=2",
        "distributed.dense.schedule=1f1b",
        "distributed.dense.microbatches=4",
    ],
}
TOWERS = {
    "dlrmv2": [],
    "over4x": ["model.over_arch_layer_sizes=[3072,2048,2048,512,1]"],
}
LOG_EVERY = 5


def rss_mib() -> float:
    """This process's resident set now, MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class PeakRSS(threading.Thread):
    """Samples :func:`rss_mib` every 5 ms until :meth:`stop`; ``peak``: the largest seen."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self._done = rss_mib(), threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_mib())
            time.sleep(0.005)

    def stop(self) -> float:
        self._done.set()
        self.join()
        self.peak = max(self.peak, rss_mib())
        return self.peak


def _probe(last_step: int, sampler: PeakRSS, out: dict):
    """A Trainer callback that, at the end of step ``last_step``, stops ``sampler`` and puts the
    peak and the rank's dense bytes into ``out``."""
    from recsys_dist.distributed.dense import dense_parameters, local_dense_bytes, optimizer_state_bytes
    from recsys_dist.distributed.optim import dense_torch_optimizer
    from recsys_dist.train.trainer import Callback

    class Probe(Callback):
        def on_step_end(self, trainer, step, loss) -> None:
            if step != last_step:
                return
            out["peak_mib"] = sampler.stop()
            params = dense_parameters(trainer.model)
            out.update(local_dense_bytes(trainer.model))
            out["optimizer"] = optimizer_state_bytes(dense_torch_optimizer(trainer.optimizer), params)
            out["parameter_count"] = sum(p.numel() for p in params)  # local (a shard under fsdp)

    return Probe()


def rank_run(rank: int, world_size: int, overrides: list[str], run_dir: str, cache: str, steps: int) -> dict:
    """One rank (under ``run_ranks``): fit configs/criteo_dlrmv2.yaml with ``overrides``; this
    rank's start RSS, peak RSS and dense bytes (see the module doc)."""
    os.environ["RECSYS_DIST_CACHE"] = cache
    from recsys_dist.api import Trainer
    from recsys_dist.config.loader import load_config

    start = rss_mib()
    sampler, out = PeakRSS(), {}
    sampler.start()
    cfg = load_config(CONFIG, [*overrides, f"distributed.nproc_per_node={world_size}"])
    with Trainer(cfg, run_dir, callbacks=[_probe(steps, sampler, out)]) as trainer:
        trainer.fit()
    import recsys_dist

    return {"start_mib": start, **out, "code": str(Path(recsys_dist.__file__).parents[1])}  # which checkout ran


BEFORE = "pipeline, before"  # LAYOUTS["pipeline"] on the --before checkout


def one_run(world_size: int, layout: str, tower: str, steps: int, batch: int, cache: str) -> dict:
    """In this (fresh) process: one training run on ``world_size`` ranks; per rank
    :func:`rank_run`'s numbers, and the run's steady samples/s."""
    from recsys_dist.testing import run_ranks

    overrides = [
        *LAYOUTS["pipeline" if layout == BEFORE else layout],
        *TOWERS[tower],
        f"train.batch_size={batch}",
        f"train.max_steps={steps}",
        f"train.log_every_n_steps={LOG_EVERY}",
        "train.epochs=10",
        "train.progress_bar=false",
        "checkpoint.enabled=false",
        "distributed.cpu_threads_per_rank=1",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(rank_run, world_size, overrides, tmp, cache, steps, timeout_s=1800)
        rate = harness.steady_rate(harness.metrics(tmp), batch * world_size)
    return {"ranks": ranks, "samples_per_s": rate, "code": ranks[0]["code"]}


def fresh_run(
    world_size: int, layout: str, tower: str, steps: int, batch: int, cache: str, before: Path | None = None
) -> dict:
    """:func:`one_run` in a fresh Python process (its memory and forkserver its own), importing
    ``recsys_dist`` from ``before`` for :data:`BEFORE` (this file from this checkout)."""
    code = "import json, sys, dense_layouts; print(json.dumps(dense_layouts.one_run(*json.loads(sys.argv[1]))))"
    env = None
    if layout == BEFORE:  # not this checkout's recsys_dist: python -c, and the ranks' forkserver, put the cwd first
        code = f"import os, sys; sys.path.remove(''); os.chdir({str(before)!r}); " + code
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(before), str(harness.ROOT / "benchmarks")])}
    argv = json.dumps([world_size, layout, tower, steps, batch, cache])
    return harness.last_json(harness.python(code, argv, env=env))


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def report(world_size: int, tower: str, got: dict[str, list[dict]]) -> None:
    """The table of one (world size, tower): per layout the medians over rounds."""
    names = list(got)
    ref = [r["samples_per_s"] for r in got["ddp"]]
    first = got["ddp"][0]["ranks"][0]
    print(f"\n### {world_size} ranks, tower {tower}: {first['parameter_count']:,} dense parameters\n")
    print(
        "| layout | dense params MiB per rank | grads MiB | Adagrad state MiB | params+grads+state MiB "
        "| peak RSS growth MiB per rank | samples/s (rounds) | samples/s / ddp (per round) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        runs = got[name]
        last = runs[-1]["ranks"]  # bytes are the same every round
        tensor = [r["parameters"] + r["gradients"] + r["optimizer"] for r in last]
        peaks = [
            harness.median([run["ranks"][i]["peak_mib"] - run["ranks"][i]["start_mib"] for run in runs])
            for i in range(world_size)
        ]
        rates = [r["samples_per_s"] for r in runs]
        ratios = harness.paired_ratios(rates, ref)
        print(
            f"| {name} | {' / '.join(mib(r['parameters']) for r in last)} "
            f"| {' / '.join(mib(r['gradients']) for r in last)} | {' / '.join(mib(r['optimizer']) for r in last)} "
            f"| {' / '.join(mib(t) for t in tensor)} | {' / '.join(f'{p:.0f}' for p in peaks)} "
            f"| {harness.median(rates):.0f} ({', '.join(f'{x:.0f}' for x in rates)}) "
            f"| {harness.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "dense_layouts", "2 ranks, tower dlrmv2, 1 round of 6 steps of 16 rows")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    p.add_argument("--towers", nargs="+", choices=list(TOWERS), default=list(TOWERS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=128, help="rows per rank per step")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), help="ddp must be one")
    p.add_argument("--before", type=Path, help="a checkout whose pipeline layout runs too (see the module doc)")
    args = p.parse_args(argv)
    if "ddp" not in args.layouts:
        p.error("--layouts: the ratios are to ddp, which must be one of them")
    names = [*args.layouts, *([BEFORE] if args.before else [])]
    if args.smoke:
        args.world_sizes, args.towers, args.rounds, args.steps, args.batch = [2], ["dlrmv2"], 1, 6, 16
    title = "Dense layouts (ddp, fsdp, pipeline) on MLPerf DLRMv2's dense sizes: memory and speed per rank"
    with harness.Results(args, argv, title=title), tempfile.TemporaryDirectory() as cache:
        print(
            f"configs/criteo_dlrmv2.yaml, {args.steps} steps of {args.batch} rows per rank, 1 thread per rank, "
            f"{args.rounds} ABBA rounds; sizes per rank as 'rank 0 / rank 1 / ...'; peak RSS growth: median over rounds"
        )
        harness.cli("preprocess", "--config", CONFIG, "--quiet", env={"RECSYS_DIST_CACHE": cache})  # once
        for world_size in args.world_sizes:
            for tower in args.towers:
                run = functools.partial(
                    fresh_run,
                    world_size,
                    tower=tower,
                    steps=args.steps,
                    batch=args.batch,
                    cache=cache,
                    before=args.before.resolve() if args.before else None,
                )
                got = harness.abba(
                    {name: functools.partial(run, name) for name in names},
                    args.rounds,
                    on_result=lambda r, n, x: print(
                        f"  round {r + 1} {n}: {x['samples_per_s']} samples/s (recsys_dist of {x['code']})", flush=True
                    ),
                )
                report(world_size, tower, got)


if __name__ == "__main__":
    main()
