"""PipeDream-2BW (distributed.dense.schedule: 2bw) vs 1f1b and gpipe: memory per stage rank, and convergence.

Memory (``--part memory``): 2 ranks, 2 stages, a wide dcnv2 tower (``--deep`` hidden sizes),
``--rows`` rows per rank cut into ``--microbatches``, ``--steps`` steps of random Criteo-shaped
batches through the Trainer's pipeline step, each schedule in fresh ranks, ``--rounds`` rounds in
ABBA order. Per rank: the bytes of its stage's parameters, of 2bw's second version W(t-1), the
peak RSS growth (VmHWM reset before the model is built, minus the RSS then) over build and steps,
the RSS growth once the model is built (W(t-1) is allocated then), and the steps' own peak over
that (activations, gradients, optimizer temporaries; VmHWM reset after the build).

Convergence (``--part convergence``): ``recsys-dist train`` of each schedule (1f1b, 2bw; 2 ranks, 2
stages) on the shipped Criteo quickstart (dlrm) and on MovieLens (configs/movielens_deepfm.yaml
with model.name=dcnv2: no shipped MovieLens config has a model pipeline can cut), ``--seeds``
seeds, then ``recsys-dist predict`` on the test split; test AUC per run and the paired bootstrap
over test rows of 2bw minus 1f1b (harness.paired_bootstrap: one row resample per replicate, the
AUC difference per seed averaged over the seeds).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/two_bw.py [--part memory convergence] [--seeds 0 1 2 3 4]
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import harness

SCHEDULES = ["1f1b", "2bw", "gpipe"]
DATA = {
    "criteo": ("criteo_quickstart.yaml", []),
    "movielens": ("movielens_deepfm.yaml", ["model.name=dcnv2"]),
}
PIPELINE = ["distributed.dense.strategy=pipeline", "distributed.dense.stages=2", "distributed.cpu_threads_per_rank=1"]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_worker(rank: int, world_size: int, schedule: str, deep: list[int], rows: int, mb: int, steps: int) -> dict:
    """One rank of the memory part (see the module doc): bytes and RSS growth in MiB."""
    import torch

    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.data.loader import CTRBatch
    from recsys_dist.distributed.dense import dense_parameters
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.distributed.two_bw import two_bw_of
    from recsys_dist.train.build import shard_model
    from recsys_dist.train.stage_pipeline import StagePipeline

    overrides = [
        "model.name=dcnv2",
        f"model.deep_layer_sizes=[{', '.join(map(str, deep))}]",
        f"train.batch_size={rows}",
        f"distributed.dense.schedule={schedule}",
        f"distributed.dense.microbatches={mb}",
        *PIPELINE,
    ]
    job = resolve_job(load_config(harness.CONFIGS / "criteo_quickstart.yaml", overrides))
    ctx = init_distributed(job.distributed)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    base = _rss_kib("VmRSS")
    torch.manual_seed(rank)
    dmp, opt = shard_model(job, ctx)[:2]
    pipe = StagePipeline(dmp, opt, ctx.device)
    built_peak = _rss_kib("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # the steps' own peak, over the built model's RSS
    built = _rss_kib("VmRSS")
    g = torch.Generator().manual_seed(rank)
    from torchrec import KeyedJaggedTensor

    for _ in range(steps):
        kjt = KeyedJaggedTensor(
            keys=[f"C{i}" for i in range(1, 27)],
            values=torch.randint(0, 10000, (26 * rows,), generator=g),
            lengths=torch.ones(26 * rows, dtype=torch.int32),
            stride=rows,
        )
        batch = CTRBatch(torch.rand(rows, 13, generator=g), kjt, torch.randint(0, 2, (rows,)).float(), torch.ones(rows))
        pipe.progress(iter([batch]))
    st = dmp.dense_stages
    own = [p for m in st.modules_of(st.index) for p in m.parameters()]
    two_bw = two_bw_of(dmp)
    mib = 2**20
    return {
        "stage_params_mib": sum(p.numel() * p.element_size() for p in own) / mib,
        "second_version_mib": sum(t.numel() * t.element_size() for t in two_bw.stale) / mib if two_bw else 0.0,
        # every dense parameter the rank holds (its own stages' since each rank frees the others)
        "tower_params_mib": sum(p.numel() * p.element_size() for p in dense_parameters(dmp)) / mib,
        "peak_rss_growth_mib": (max(built_peak, _rss_kib("VmHWM")) - base) / 1024,
        "built_rss_growth_mib": (built - base) / 1024,
        "steps_peak_over_built_mib": (_rss_kib("VmHWM") - built) / 1024,
    }


def memory(args) -> dict:
    import two_bw  # by module name: the ranks unpickle the worker from it

    from recsys_dist.testing import run_ranks

    rows: dict = {s: [] for s in SCHEDULES}
    for r in range(args.rounds):
        for schedule in harness.abba_order(SCHEDULES, r):
            got = run_ranks(
                two_bw.memory_worker, 2, schedule, args.deep, args.rows, args.microbatches, args.steps, timeout_s=900
            )
            rows[schedule].append(got)
            print("memory", r, schedule, json.dumps(got), flush=True)
    print(
        "| schedule | rank | stage params MiB | W(t-1) MiB | tower params held MiB | peak RSS growth MiB (rounds) | median "
        "| RSS after build, growth (median) | steps' peak over it (median) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for schedule in SCHEDULES:
        for rank in range(2):
            per = [g[rank] for g in rows[schedule]]
            growth = [p["peak_rss_growth_mib"] for p in per]
            built = harness.median([p.get("built_rss_growth_mib", float("nan")) for p in per])
            steps = harness.median([p.get("steps_peak_over_built_mib", float("nan")) for p in per])
            print(
                f"| {schedule} | {rank} | {per[0]['stage_params_mib']:.1f} | {per[0]['second_version_mib']:.1f} | "
                f"{per[0]['tower_params_mib']:.1f} | {' / '.join(f'{x:.1f}' for x in growth)} | "
                f"{harness.median(growth):.1f} | {built:.1f} | {steps:.1f} |"
            )
    return rows


def convergence(args, extra: list[str]) -> dict:
    import numpy as np
    import pyarrow.parquet as pq
    from sklearn.metrics import roc_auc_score

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.out or tmp
        for data in args.data:
            name, model = DATA[data]
            config = harness.CONFIGS / name
            test = harness.converted_test_split(config, *model)
            preds: dict = {"1f1b": [], "2bw": []}
            runs: dict = {"1f1b": [], "2bw": []}
            labels = None
            for seed in args.seeds:
                for schedule in harness.abba_order(["1f1b", "2bw"], seed):
                    rd = Path(tmp) / f"{data}-{schedule}-{seed}"
                    out = Path(tmp) / f"{data}-{schedule}-{seed}.parquet"
                    shutil.rmtree(rd, ignore_errors=True)
                    s = harness.train(
                        config,
                        rd,
                        *model,
                        *PIPELINE,
                        f"distributed.dense.schedule={schedule}",
                        f"train.seed={seed}",
                        *extra,
                    )
                    harness.cli("predict", rd, "--data", test, "--out", out)
                    t = pq.read_table(out)
                    y = t.column("label").to_numpy()
                    labels = y if labels is None else labels
                    assert np.array_equal(labels, y), "the runs scored different rows"
                    preds[schedule].append(t.column("logit").to_numpy())
                    auc = roc_auc_score(labels, preds[schedule][-1])
                    runs[schedule].append({"seed": seed, "test_auc": auc, "samples_per_s": s.get("samples_per_s")})
                    print(data, schedule, seed, f"test AUC {auc:.5f}", flush=True)
            mean, ci95 = harness.paired_bootstrap(labels, preds["2bw"], preds["1f1b"], roc_auc_score, n=args.boot)
            report[data] = {
                "runs": runs,
                "auc_mean": {k: float(np.mean([r["test_auc"] for r in v])) for k, v in runs.items()},
                "auc_2bw_minus_1f1b": {"mean": mean, "ci95": ci95},
                "test_rows": len(labels),
            }
            print(json.dumps(report[data], indent=1), flush=True)
    print("| data | test rows | seeds | 1f1b AUC (mean) | 2bw AUC (mean) | 2bw - 1f1b | 95% paired bootstrap |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for data, r in report.items():
        d = r["auc_2bw_minus_1f1b"]
        print(
            f"| {data} | {r['test_rows']} | {len(args.seeds)} | {r['auc_mean']['1f1b']:.5f} | "
            f"{r['auc_mean']['2bw']:.5f} | {d['mean']:+.5f} | [{d['ci95'][0]:+.5f}, {d['ci95'][1]:+.5f}] |"
        )
    return report


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(
        __doc__, "two_bw", "memory: 1 round, 2 steps, narrow tower; convergence: criteo, seed 0, 4 steps"
    )
    p.add_argument("--part", nargs="+", default=["memory", "convergence"], choices=["memory", "convergence"])
    p.add_argument("--deep", type=int, nargs="+", default=[2048, 2048, 2048])
    p.add_argument("--rows", type=int, default=512, help="rows per rank (memory part)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--data", nargs="+", default=list(DATA), choices=list(DATA))
    p.add_argument("--boot", type=int, default=1000)
    p.add_argument("--out", help="keep the convergence runs here")
    args = p.parse_args(argv)
    extra: list[str] = []
    if args.smoke:
        args.deep, args.rows, args.steps, args.rounds = [64, 64], 32, 2, 1
        args.seeds, args.data, args.boot, extra = [0], ["criteo"], 20, harness.SMOKE_TRAIN
    os.environ.setdefault("PYTHONPATH", str(harness.ROOT))
    with harness.Results(args, argv):
        if "memory" in args.part:
            memory(args)
        if "convergence" in args.part:
            convergence(args, extra)


if __name__ == "__main__":
    main()
