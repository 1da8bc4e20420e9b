"""Training throughput under streaming (``data.stream``) vs the same rows as one batch file.

The model and training settings are those of ``configs/criteo_online.yaml`` (DLRM, 2 ranks,
global batch 64, checkpoint every 50 steps). The first ``--partitions`` x ``--rows`` rows of
the shipped Criteo sample are:

- **stream**: landed as that many partitions before the run starts (``pipelines/criteo_hourly.py``'s
  ``land()``), trained with ``stop_after_idle_seconds: 0``, with ``progressive_validation``
  on (``stream_pv``) and off (``stream``); a checkpoint at each partition's end, as the stream
  loop always does; ``stream_pub``: as ``stream_pv`` and publishing after each partition, as
  ``configs/criteo_online.yaml`` does (the other variants run without a ``publish`` section);
- **batch**: one file of the same rows, ``data.split: [1, 0, 0]`` (every row trains, no
  validation or test rows), ``train.epochs: 1``.

Every run converts its data cold (batch: a fresh ``data.cache_dir``; a stream converts its
partitions into the run directory), as a landing partition always is. The variants run back to
back in each repetition, in ABBA order over the repetitions (benchmarks/harness.py). Reported per run:
``summary.json`` ``samples_per_s`` / ``train_seconds`` (training steps only, no evaluation),
``wall_seconds`` and ``wall_split``, the process's wall time, and the stream's ``partition``
lines' ``seconds``; then medians and stream / batch ratios. Not a test. Usage:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/stream_throughput.py [--partitions 8] [--rows 1000]
        [--reps 3] [--variants batch,stream,stream_pub] [--before OTHER_CHECKOUT] [--record ITEM | --out FILE.md]

It always writes its results file: benchmarks/results/stream_throughput_<hw>_<YYYYMMDD>.md unless
``--record ITEM`` or ``--out FILE`` says otherwise (``--smoke``: only with ``--out``).

The report ends each round (a repetition) with every stream variant's samples/s over the batch
file's of the same round, and their median over the rounds; ``--before`` runs each stream variant
also with another checkout's ``recsys_dist`` (``VARIANT@before``), in the same rounds.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
from pathlib import Path

import harness

ONLINE = harness.CONFIGS / "criteo_online.yaml"
VARIANTS = ("batch", "stream_pv", "stream", "stream_pub")
BEFORE = "@before"  # suffix of a variant run from --before's checkout (the same config)


def hourly():
    """``pipelines/criteo_hourly.py`` as a module (``land``, ``partition_name``); pipelines/ is
    not a package."""
    return harness.load_file(harness.ROOT / "pipelines" / "criteo_hourly.py", "criteo_hourly")


def make_configs(work: Path, partitions: int, rows: int) -> dict[str, dict]:
    """Land the partitions, write the batch file; the three configs (dicts) keyed by variant."""
    import yaml

    lines = harness.SAMPLE.read_bytes().splitlines(keepends=True)[: partitions * rows]
    h = hourly()
    for i in range(partitions):
        h.land(work / "landing", h.partition_name(i), lines[i * rows : (i + 1) * rows])
    (work / "batch.txt").write_bytes(b"".join(lines))
    base = yaml.safe_load(ONLINE.read_text())
    out = {}
    for variant in VARIANTS:
        cfg = json.loads(json.dumps(base))
        data = cfg["data"]
        if variant != "stream_pub":  # training throughput: publishing only where the variant says
            cfg.pop("publish", None)
        if variant == "batch":
            del data["stream"]
            data.update(raw_path=str(work / "batch.txt"), split=[1.0, 0.0, 0.0])
            cfg["train"]["epochs"] = 1
        else:
            data["stream"].update(
                path=str(work / "landing"),
                stop_after_idle_seconds=0,
                progressive_validation=variant != "stream",
                min_file_age_seconds=0,  # landed by rename (criteo_hourly.land)
            )
        if variant != "stream_pub" or "publish" in cfg:  # stream_pub: where criteo_online.yaml publishes
            out[variant] = cfg
    return out


def run_once(work: Path, variant: str, cfg: dict, rep: int, root: Path = harness.ROOT) -> dict:
    """One ``recsys-dist train`` of ``cfg`` in a fresh run and cache directory, with the
    ``recsys_dist`` of checkout ``root``."""
    import yaml

    name = f"{variant}_{rep}".replace(BEFORE, "_before")
    cfg = json.loads(json.dumps(cfg))
    if "stream" not in cfg["data"]:  # a stream converts into RUN_DIR/partitions (always cold)
        cfg["data"]["cache_dir"] = str(work / "cache" / name)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = work / "runs" / name
    load0 = os.getloadavg()[0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    _, process_s = harness.cli("train", "--config", path, "--run-dir", run_dir, code=root)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the launcher and its ranks (waited for)
    cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    summary = harness.summary(run_dir)
    parts = [x["seconds"] for x in harness.metrics(run_dir) if x.get("split") == "partition"]
    return {
        "variant": variant,
        "rep": rep,
        "steps": summary["steps"],
        "rows": summary["rows_trained"],
        "train_s": summary["train_seconds"],
        "samples_s": summary["samples_per_s"],
        "wall_s": summary["wall_seconds"],
        "process_s": round(process_s, 2),
        "cpu_s": round(cpu_s, 2),
        "split": summary["wall_split"],
        "partition_s": parts,
        "load": (round(load0, 2), round(os.getloadavg()[0], 2)),
    }


def med(results: list[dict], variant: str, key: str) -> float:
    return harness.median([r[key] for r in results if r["variant"] == variant])


def best(results: list[dict], variant: str, key: str, pick) -> float:
    return pick(r[key] for r in results if r["variant"] == variant)


def report(results: list[dict], args) -> str:
    """The markdown report: setup, a row per run, per-round ratios, medians and ratios per variant."""
    phases = list(results[0]["split"])
    out = [
        f"- **Data:** the first {args.partitions * args.rows:,} rows of `datasets/criteo_kaggle/dac_train_first10000.txt`: "
        f"{args.partitions} partitions of {args.rows:,} rows landed before the start (stream), or one file (batch, "
        "`data.split: [1, 0, 0]`, `train.epochs: 1`). Model and training settings of `configs/criteo_online.yaml` "
        "(DLRM, 2 ranks, global batch 64, checkpoint every 50 steps; the stream also at each partition's end). "
        "Cold conversion every run (batch: a fresh `data.cache_dir`; stream: main converts each partition into the run directory). `stream_pv`: progressive validation on; `stream`: off; "
        "`stream_pub`: on, and publishing after each partition (`publish.every_partition`, as criteo_online.yaml; "
        "the others without a `publish` section).",
        "- **Load:** the machine is shared with other jobs: the 1-minute load average per run below.",
        "",
        "Per run (`train_s` / `samples/s`: summary.json, training steps only; `wall_s`: summary.json "
        "`wall_seconds`; `process_s`: the command's wall time; partition s: the stream's `partition` lines):",
        "",
        "| run | steps | train_s | samples/s | wall_s | process_s | cpu_s | "
        + " | ".join(phases)
        + " | partition s (min / median / max) | load 1-min (start, end) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in phases) + " | --- | --- |",
    ]
    for r in results:
        p = r["partition_s"]
        ps = f"{min(p):.3f} / {harness.median(p):.3f} / {max(p):.3f}" if p else "-"
        out.append(
            f"| {r['variant']} #{r['rep']} | {r['steps']} | {r['train_s']:.3f} | {r['samples_s']:,.0f} | "
            f"{r['wall_s']:.2f} | {r['process_s']:.2f} | {r.get('cpu_s', float('nan')):.2f} | "
            + " | ".join(f"{r['split'][k]:.2f}" for k in phases)
            + f" | {ps} | {r['load'][0]}, {r['load'][1]} |"
        )
    out += _rounds(results)
    out += [
        "",
        "Over the repetitions: medians, stream / batch ratios of the medians, and the median (min - max) of the "
        "ratios within one repetition (its variants ran back to back). `best`: the fastest repetition (least "
        "disturbed by the other jobs). `ms/step`: best train_s / steps (the stream has a short last batch per "
        "partition: more steps for the same rows). `job_s`: wall_s minus startup, plan and tables (what the data "
        "costs: conversion, training, evaluation, checkpoints, publishing). `cpu_s`: user + system CPU seconds of "
        "the whole command (launcher and ranks), less sensitive to the other jobs than wall time.",
        "",
        "| variant | samples/s: median | ratio | paired ratio | best | ratio | ms/step | job_s: median | ratio | "
        "paired ratio | best | ratio | cpu_s: median | ratio | wall_s | " + " | ".join(phases) + " |",
        "| --- |" + " ---: |" * (14 + len(phases)),
    ]
    for r in results:
        r["job_s"] = r["wall_s"] - sum(r["split"].get(k, 0.0) for k in ("startup", "plan", "tables"))
        r.setdefault("cpu_s", float("nan"))
    b_sps, b_job, b_cpu = (med(results, "batch", k) for k in ("samples_s", "job_s", "cpu_s"))
    b_best, b_job_best = best(results, "batch", "samples_s", max), best(results, "batch", "job_s", min)
    for v in _present(results):
        sps, job, cpu = (med(results, v, k) for k in ("samples_s", "job_s", "cpu_s"))
        sps_best, job_best = best(results, v, "samples_s", max), best(results, v, "job_s", min)
        steps = results[[r["variant"] for r in results].index(v)]["steps"]
        split = [harness.median([r["split"][k] for r in results if r["variant"] == v]) for k in phases]
        out.append(
            f"| {v} | {sps:,.0f} | {sps / b_sps:.3f} | {_paired(results, v, 'samples_s')} | {sps_best:,.0f} | "
            f"{sps_best / b_best:.3f} | {1000 * best(results, v, 'train_s', min) / steps:.1f} | {job:.2f} | "
            f"{job / b_job:.3f} | {_paired(results, v, 'job_s')} | {job_best:.2f} | {job_best / b_job_best:.3f} | "
            f"{cpu:.1f} | {cpu / b_cpu:.3f} | {med(results, v, 'wall_s'):.2f} | "
            + " | ".join(f"{x:.2f}" for x in split)
            + " |"
        )
    return "\n".join(out) + "\n"


def _present(results: list[dict]) -> list[str]:
    """The variants run, in VARIANTS order, each followed by its ``@before`` run."""
    names = {r["variant"] for r in results}
    return [x for v in VARIANTS for x in (v, v + BEFORE) if x in names]


def _rounds(results: list[dict]) -> list[str]:
    """Per repetition (its variants ran back to back, interleaved with the other repetitions'):
    each stream variant's samples/s over the batch file's, then the median of those ratios."""
    streams = [v for v in _present(results) if v != "batch"]
    base = {r["rep"]: r["samples_s"] for r in results if r["variant"] == "batch"}
    if not streams or not base:
        return []
    out = [
        "",
        "Per round: samples/s of each stream variant / the batch file's in the same round (the variants of a "
        "round ran back to back; rounds interleave in ABBA order), and the median over the rounds:",
        "",
        "| round | batch samples/s | " + " | ".join(f"{v} / batch" for v in streams) + " |",
        "| ---: | ---: |" + " ---: |" * len(streams),
    ]
    ratios: dict[str, list[float]] = {v: [] for v in streams}
    for rep in sorted(base):
        row = []
        for v in streams:
            got = [r["samples_s"] for r in results if r["variant"] == v and r["rep"] == rep]
            if got:
                ratios[v].append(got[0] / base[rep])
            row.append(f"{got[0] / base[rep]:.3f}" if got else "-")
        out.append(f"| {rep} | {base[rep]:,.0f} | " + " | ".join(row) + " |")
    out.append(
        "| **median** | "
        + f"{harness.median(base.values()):,.0f} | "
        + " | ".join(f"**{harness.median(ratios[v]):.3f}**" if ratios[v] else "-" for v in streams)
        + " |"
    )
    return out


def _paired(results: list[dict], variant: str, key: str) -> str:
    """Median (min - max) over repetitions of ``variant``'s ``key`` / batch's, same repetition."""
    base = {r["rep"]: r[key] for r in results if r["variant"] == "batch"}
    ratios = [r[key] / base[r["rep"]] for r in results if r["variant"] == variant and r["rep"] in base]
    return f"{harness.median(ratios):.3f} ({min(ratios):.2f} - {max(ratios):.2f})" if ratios else "-"


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, "stream_throughput", "2 partitions of 200 rows, 1 round")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1000, help="rows per partition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS)
    )
    parser.add_argument(
        "--before",
        default=None,
        help="another checkout (e.g. `git worktree add /tmp/before main`): each stream variant also runs "
        "with its recsys_dist, as VARIANT@before, in the same rounds",
    )
    parser.add_argument("--keep", default=None, help="work directory to keep (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="the results file (default: the one --record names)")
    parser.add_argument(
        "--rerender", default=None, help="write the report from an earlier run's output (its JSON lines)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.partitions, args.rows, args.reps = 2, 200, 1
    elif args.record is None and args.out is None:
        args.record = "stream_throughput"  # always recorded
    title = "`benchmarks/stream_throughput.py`: streaming vs one batch file"
    with harness.Results(args, argv, path=args.out, title=title) as res:
        if args.rerender:
            lines = Path(args.rerender).read_text().splitlines()
            results = [json.loads(x) for x in lines if x.startswith('{"variant"')]
            cmd = next((x.split("`")[1] for x in lines if x.startswith("- **Command:**")), "not recorded")
            note = f"Re-rendered from `{args.rerender}`: the run's command `{cmd}`; its machine and time are there."
            res.markdown = note + "\n\n" + report(results, args)
        else:
            res.markdown = report(run(args), args)
        print(res.markdown)


def run(args) -> list[dict]:
    """Every variant once a round, ``--reps`` rounds in ABBA order; a dict per run (printed)."""
    with tempfile.TemporaryDirectory(prefix="stream_tp_") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        configs = make_configs(work, args.partitions, args.rows)
        results = []
        variants = [v for v in VARIANTS if v in configs and v in args.variants.split(",")]
        if args.before:  # each stream variant also from the other checkout, interleaved
            variants += [v + BEFORE for v in variants if v != "batch"]
        for rep in range(args.reps):
            for v in harness.abba_order(variants, rep):
                root = Path(args.before) if v.endswith(BEFORE) else harness.ROOT
                r = run_once(work, v, configs[v.removesuffix(BEFORE)], rep, root)
                print(json.dumps(r), flush=True)
                results.append(r)
    return results


if __name__ == "__main__":
    main()
