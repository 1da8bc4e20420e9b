"""Where a stream's time goes, per partition: in-process timers around its parts, this checkout
against another one (``--before``), alternating.

Each run is ``benchmarks/stream_throughput.py``'s ``stream_pub`` (``configs/criteo_online.yaml``:
DLRM, 2 ranks, progressive validation, a checkpoint and a published version per partition) on
``--partitions`` x ``--rows`` rows. Every rank imports a ``sitecustomize`` written into a
temporary directory that wraps, with ``time.perf_counter``: the pipeline's steps (``progress``:
the first of each partition apart), TorchRec's model rewrite (``_pipeline_model``: the fx trace
of a new pipeline), the conversion and loaders (``StreamTrainer._open``), progressive validation
(``_score_partition``), ``save_checkpoint``, the publish (``PublishCallback._publish``: with the
gather of the weights, where the checkout has it). Per run one JSON line (rank 0's timers and
summary.json); then medians per checkout and the per-round ratios. Not a test. Usage:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/stream_profile.py [--before /tmp/before] [--rounds 6]

The checkouts alternate in ABBA order over the rounds (benchmarks/harness.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import harness
import stream_throughput  # the same data and config as the throughput benchmark

HOOKS = """
import atexit, collections, functools, json, os, time
T = collections.defaultdict(list)

def _timed(key, f):
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[key].append(time.perf_counter() - t)
    return w

def _dump():
    with open(os.path.join(os.environ["STREAM_PROFILE_OUT"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(T, f)

import torchrec.distributed.train_pipeline.train_pipelines as tp
from recsys_dist.serve import publish_callback
from recsys_dist.train import observe, stream, trainer
tp.TrainPipelineSparseDist._pipeline_model = _timed("trace", tp.TrainPipelineSparseDist._pipeline_model)
observe.TimedTrainPipeline.progress = _timed("progress", observe.TimedTrainPipeline.progress)
for name in ("_open", "_score_partition"):
    setattr(stream.StreamData, name, _timed(name, getattr(stream.StreamData, name)))
trainer.Trainer.save_checkpoint = _timed("save_checkpoint", trainer.Trainer.save_checkpoint)
publish_callback.PublishCallback._publish = _timed("publish", publish_callback.PublishCallback._publish)
if hasattr(publishing, "gather_full_state"):
    publish_callback.gather_full_state = _timed("gather", publish_callback.gather_full_state)
_fit = stream.StreamTrainer.fit
def fit(self):
    try:
        return _fit(self)
    finally:
        _dump()  # ranks leave with os._exit: no atexit
stream.StreamTrainer.fit = fit
"""


def run(work: Path, root: Path, name: str, cfg_path: Path, hooks: Path, steps_per_partition: int) -> dict:
    """One stream run with the timers of :data:`HOOKS`, the recsys_dist of checkout ``root``;
    rank 0's timers (ms) and summary."""
    out = work / "timers" / name
    out.mkdir(parents=True, exist_ok=True)
    run_dir = work / "runs" / name
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), str(root)]), "STREAM_PROFILE_OUT": str(out)}
    harness.cli("train", "--config", cfg_path, "--run-dir", run_dir, code=root, env=env)
    t = {k: [x * 1000 for x in v] for k, v in json.loads((out / "rank0.json").read_text()).items()}
    p, k = t["progress"], steps_per_partition + 1  # + the call that finds the partition's end
    summary = harness.summary(run_dir)
    firsts = [p[i] for i in range(k, len(p), k)]  # partitions 2..n
    steady = [x for i in range(0, len(p), k) for x in p[i + 2 : i + k - 1]]
    return {
        "run": name,
        "samples_per_s": summary["samples_per_s"],
        "steps_ms": round(sum(p), 1),
        "first_step_ms": round(harness.median(firsts), 1) if firsts else float("nan"),
        "steady_step_ms": round(harness.median(steady), 2) if steady else float("nan"),
        "traces": len(t.get("trace", [])),
        **{f"{key}_ms": round(sum(t.get(key, [])), 1) for key in ("trace", "_open", "_score_partition")},
        **{f"{key}_ms": round(sum(t.get(key, [])), 1) for key in ("save_checkpoint", "publish", "gather")},
        "load": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, "stream_profile", "1 round of 2 partitions of 200 rows")
    parser.add_argument("--before", default=None, help="another checkout to alternate with (its recsys_dist)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.partitions, args.rows = 1, 2, 200
    with harness.Results(args, argv):
        report(profile(args), args)


def profile(args) -> list[dict]:
    """Every checkout once a round, ``--rounds`` rounds in ABBA order; a dict per run (printed)."""
    import yaml

    roots = {"this": harness.ROOT, **({"before": Path(args.before)} if args.before else {})}
    with tempfile.TemporaryDirectory(prefix="stream_profile_") as tmp:
        work = Path(tmp)
        cfg = stream_throughput.make_configs(work, args.partitions, args.rows)["stream_pub"]
        cfg_path = work / "stream_pub.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        hooks = work / "hooks"
        hooks.mkdir()
        (hooks / "sitecustomize.py").write_text(HOOKS)
        steps = -(-args.rows // (cfg["train"]["batch_size"] * cfg["distributed"]["nproc_per_node"]))
        results = []
        for i in range(args.rounds):
            for which in harness.abba_order(list(roots), i):
                r = {"checkout": which, "round": i, **run(work, roots[which], f"{which}_{i}", cfg_path, hooks, steps)}
                print(json.dumps(r), flush=True)
                results.append(r)
    return results


def report(results: list[dict], args) -> None:
    """Medians per checkout; with --before, the ratios per round."""
    checkouts = list(dict.fromkeys(r["checkout"] for r in results))
    keys = [k for k in results[0] if k.endswith("_ms") or k in ("samples_per_s", "traces")]
    print("\n| median | " + " | ".join(keys) + " |\n| --- |" + " ---: |" * len(keys))
    for which in checkouts:
        mine = [r for r in results if r["checkout"] == which]
        print(f"| {which} | " + " | ".join(f"{harness.median([r[k] for r in mine]):g}" for k in keys) + " |")
    if "before" in checkouts:
        this, before = ([r for r in results if r["checkout"] == w] for w in ("this", "before"))
        print(
            "\nper round, this / before: "
            + ", ".join(
                f"samples/s {a['samples_per_s'] / b['samples_per_s']:.3f} steps {a['steps_ms'] / b['steps_ms']:.3f} "
                f"publish {a['publish_ms'] / b['publish_ms']:.2f}"
                for a, b in zip(this, before)
            )
        )


if __name__ == "__main__":
    main()
