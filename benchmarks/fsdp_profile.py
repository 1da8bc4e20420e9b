"""Where fsdp's step time goes against ddp's on CPU (issue 38): torch.profiler on rank 0 of a
2-rank run of configs/criteo_dlrmv2.yaml (benchmarks/dense_layouts.py's setup).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fsdp_profile.py [--layouts ddp fsdp] [--steps 14]
        [--profile-steps 6] [--batch 128] [--extra fsdp:KEY=VALUE ...] [--json FILE] [--record]

Per layout one fresh 2-rank run; rank 0 profiles its last ``--profile-steps`` steps (CPU
activities, shapes recorded) and prints, per step, the wall time of the step, the profiler's
top ops by self CPU time, and every collective (gloo: ``c10d::`` / ``gloo:`` events) with its
count, total time and input shapes. ``--extra LAYOUT:KEY=VALUE`` adds a config override to
one layout (e.g. ``fsdp:train.dense_optimizer=adam``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import dense_layouts
import harness


def _profiler_callback(first: int, last: int, out: dict):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from recsys_dist.train.trainer import Callback

    class Prof(Callback):
        prof = None
        t0 = 0.0

        def on_step_end(self, trainer, step, loss) -> None:
            if step == first - 1:
                self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                self.prof.__enter__()
                self.t0 = time.perf_counter()
            elif step == last and self.prof is not None:
                float(loss)
                wall = time.perf_counter() - self.t0
                self.prof.__exit__(None, None, None)
                if torch.distributed.get_rank() != 0:
                    return
                n = last - first + 1
                ka = self.prof.key_averages(group_by_input_shape=True)
                rows = []
                for e in ka:
                    rows.append(
                        [
                            e.key,
                            e.count / n,
                            e.self_cpu_time_total / n / 1e3,
                            e.cpu_time_total / n / 1e3,
                            str(e.input_shapes)[:120],
                        ]
                    )
                out["wall_ms_per_step"] = wall / n * 1e3
                out["rows"] = rows
                out["table"] = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)

    return Prof()


def rank_run(
    rank: int, world_size: int, overrides: list[str], run_dir: str, cache: str, steps: int, nprof: int
) -> dict:
    os.environ["RECSYS_DIST_CACHE"] = cache
    from recsys_dist.api import Trainer
    from recsys_dist.config.loader import load_config

    out: dict = {}
    cfg = load_config(dense_layouts.CONFIG, [*overrides, f"distributed.nproc_per_node={world_size}"])
    with Trainer(cfg, run_dir, callbacks=[_profiler_callback(steps - nprof + 1, steps, out)]) as trainer:
        trainer.fit()
    return out


def one_run(layout: str, extra: list[str], steps: int, nprof: int, batch: int, cache: str) -> dict:
    from recsys_dist.testing import run_ranks

    overrides = [
        *dense_layouts.LAYOUTS[layout],
        *extra,
        f"train.batch_size={batch}",
        f"train.max_steps={steps}",
        "train.log_every_n_steps=1000",
        "train.epochs=10",
        "train.progress_bar=false",
        "checkpoint.enabled=false",
        "distributed.cpu_threads_per_rank=1",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(rank_run, 2, overrides, tmp, cache, steps, nprof, timeout_s=1800)
    return ranks[0]


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "fsdp_profile", "4 steps of 16 rows, 2 profiled")
    p.add_argument("--layouts", nargs="+", default=["ddp", "fsdp"], choices=list(dense_layouts.LAYOUTS))
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--profile-steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=128, help="rows per rank per step")
    p.add_argument("--extra", nargs="*", default=[], help="LAYOUT:KEY=VALUE, a config override for one layout")
    p.add_argument(
        "--json", help="also write every layout's rows (name, calls/step, self ms/step, ms/step, shapes) here"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.profile_steps, args.batch = 4, 2, 16
    got = {}
    title = "fsdp against ddp on CPU: torch.profiler on rank 0 of 2 (configs/criteo_dlrmv2.yaml)"
    with harness.Results(args, argv, title=title), tempfile.TemporaryDirectory() as cache:
        print(
            f"{args.steps} steps of {args.batch} rows per rank, the last {args.profile_steps} profiled, 1 thread per rank"
        )
        harness.cli("preprocess", "--config", dense_layouts.CONFIG, "--quiet", env={"RECSYS_DIST_CACHE": cache})
        for layout in args.layouts:
            extra = [e.split(":", 1)[1] for e in args.extra if e.split(":", 1)[0] == layout]
            code = "import json, sys, fsdp_profile; print(json.dumps(fsdp_profile.one_run(*json.loads(sys.argv[1]))))"
            argv_ = json.dumps([layout, extra, args.steps, args.profile_steps, args.batch, cache])
            r = got[layout] = harness.last_json(harness.python(code, argv_))
            print(f"\n{layout} {extra}: {r['wall_ms_per_step']:.1f} ms/step (rank 0, profiled steps)\n")
            print(r["table"])
            print("collectives (calls, self ms and total ms per step, input shapes):")
            comm = [x for x in r["rows"] if any(k in x[0] for k in ("c10d", "gloo", "FSDP", "fsdp"))]
            for x in sorted(comm, key=lambda x: -x[3])[:25]:
                print(f"  {x[0]:<30} {x[1]:5.1f} {x[2]:8.2f} {x[3]:8.2f} {x[4]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f)


if __name__ == "__main__":
    main()
