"""``recsys-dist`` command line.

recsys-dist train --config configs/criteo_quickstart.yaml [--run-dir DIR] [key=value ...]
recsys-dist plan --config configs/mlperf_dlrmv2.yaml --world-size 64 --local-world-size 8 --hbm-gb 80
recsys-dist report RUN_DIR          (summary table + PNG plots in RUN_DIR)
recsys-dist compare RUN_A RUN_B
recsys-dist bench [--quick]     (benchmarks/run.py: ratios vs peers and the hardware limit)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from recsys_dist.cli import train as train_cmd
from recsys_dist.config.base import ConfigError
from recsys_dist.config.loader import load_config
from recsys_dist.train.preflight import check_sections


def _quiet_third_party() -> None:
    # TorchRec and torch.fx warn on every run about internals a user cannot act on.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("torch.fx._symbolic_trace", "torchrec", "torch.distributed", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _user_errors() -> tuple:
    from recsys_dist.checkpoint.dcp import CheckpointError
    from recsys_dist.errors import DataError
    from recsys_dist.train.metrics_writer import MetricsError

    return (ConfigError, DataError, CheckpointError, MetricsError, FloatingPointError)


def run(argv: list[str] | None = None) -> None:
    """Console entry point: ``main(argv)`` (default: the command line), then leave without
    interpreter finalisation, which aborted ~1 run in 5 with SIGABRT when a native (pyarrow /
    torch) thread was still being torn down after an error had already been reported. Never
    returns; a usage error leaves through argparse's ``SystemExit``."""
    train_cmd._ENTRY_POINT = True
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_plan(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.hbm_gb is not None:
        overrides.append(f"sharding.hbm_gb={args.hbm_gb}")
    if args.ddr_gb is not None:
        overrides.append(f"sharding.ddr_gb={args.ddr_gb}")
    cfg = load_config(args.config, overrides, check_files=False)  # planning reads no data
    check_sections(cfg)  # the cross-section rules (RunConfig checks each section alone)
    if args.local_world_size > args.world_size or args.world_size % args.local_world_size:
        raise ConfigError(f"--local-world-size {args.local_world_size} must divide --world-size {args.world_size}")
    _quiet_third_party()
    logging.getLogger().setLevel(logging.ERROR)  # the planner logs through the root logger
    from recsys_dist.distributed.dry_run import PlanError, dry_run

    try:
        report = dry_run(cfg, args.world_size, args.local_world_size, args.device)
    except PlanError as err:
        print(f"recsys-dist plan: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "placements": [p.__dict__ for p in report.placements],
                    "hbm_gb": report.hbm_gb,
                    "ddr_gb": report.ddr_gb,
                    "cost_ms": report.cost_ms,
                    "imbalance": report.imbalance,
                    "ledger": report.ledger.to_dict() if report.ledger else None,
                },
                indent=2,
            )
        )
    else:
        print(report.text())
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from recsys_dist.data.config import raw_paths

    missing = [r for r in raw_paths(cfg.data) if not Path(r).is_file()]
    if cfg.data.raw_path is None or missing:
        raise ConfigError(f"data.raw_path: {missing[0] if missing else None} is not a file")
    from recsys_dist.data.resolve import prepare_from_config

    prepared = prepare_from_config(cfg, progress=not args.quiet)
    manifest = json.loads((prepared.directory / "manifest.json").read_text())
    rows = ", ".join(f"{k} {v:,}" for k, v in prepared.rows.items())
    from recsys_dist.data.config import describe_raw_path

    print(
        f"recsys-dist: {describe_raw_path(manifest['source'])} -> {prepared.directory}\n  rows: {rows}; "
        f"skipped {manifest['rows_skipped']:,}\n  manifest: {prepared.directory / 'manifest.json'}"
    )
    return 0


def _model_path(args: argparse.Namespace) -> Path:
    """The MODEL argument of export / evaluate / predict: ``best`` or ``latest`` of
    ``--run-dir``, or a path as given.

    Raises:
        ConfigError: ``best`` / ``latest`` without ``--run-dir``, or ``--run-dir`` with a path;
            a ``--run-dir`` that does not exist or holds no ``checkpoints/``; a MODEL path that
            does not exist.
        CheckpointError: the run has no such checkpoint.
    """
    if args.model in ("best", "latest"):
        if not args.run_dir:
            raise ConfigError(f"MODEL {args.model} names a checkpoint of a run: give the run with --run-dir")
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            raise ConfigError(
                f"--run-dir {run_dir}: {'is a file' if run_dir.exists() else 'does not exist'}; give the directory "
                "of a training run (runs/<config>-<time>, or the --run-dir it was trained with)"
            )
        if not (run_dir / "checkpoints").is_dir():
            raise ConfigError(
                f"--run-dir {run_dir}: has no checkpoints/ folder, so no {args.model} checkpoint (not a run "
                "directory, or a run trained with checkpoint.enabled: false, or one that has not yet saved one)"
            )
        from recsys_dist.checkpoint.meta import named_checkpoint

        return named_checkpoint(args.model, run_dir)
    if args.run_dir:
        raise ConfigError(f"--run-dir goes with MODEL best or latest; {args.model} is a path already")
    if not Path(args.model).exists():
        raise ConfigError(
            f"MODEL {args.model}: does not exist; give a run, checkpoint or export directory, or best / latest "
            "with --run-dir RUN"
        )
    return Path(args.model)


def cmd_export(args: argparse.Namespace) -> int:
    _quiet_third_party()
    from recsys_dist.serve.export import export

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file; give a directory (it is created if missing)")
    written = export(_model_path(args), args.out, args.format)
    print(f"recsys-dist: exported {args.model} to {args.out}: {', '.join(p.name for p in written)}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    _quiet_third_party()
    import torch

    from recsys_dist.serve.export import load, score
    from recsys_dist.train.metrics import binary_metrics, task_metrics

    m = load(_model_path(args))
    scores = score(m.cfg, m.model, args.data, preprocessing=m.preprocessing)
    if not scores["labelled"]:
        from recsys_dist.errors import DataError

        raise DataError(
            f"{args.data}: no label column (Criteo's 39-field test layout, or no data.schema.label column), so "
            "there is nothing to evaluate against; `recsys-dist predict` scores it"
        )
    logit, label = torch.from_numpy(scores["logit"]), torch.from_numpy(scores["label"])
    if logit.dim() == 2:  # several tasks: <task>/<metric>, unweighted (every row of the file counts 1)
        metrics = {"num_examples": len(logit)}
        for t, (name, kind) in enumerate(zip(scores["tasks"], scores["kinds"])):
            got = task_metrics(logit[:, t], label[:, t], torch.ones(len(logit)), kind)
            metrics.update({f"{name}/{k}": v for k, v in got.items() if k not in ("num_examples", "weight_sum")})
    else:
        metrics = binary_metrics(logit, label)
    print(json.dumps({"model": m.source, "data": str(args.data), **metrics, **scores.get("managed", {})}))
    return 0


def _keep_columns(text: str | None) -> list[str]:
    from recsys_dist.serve.export import OUTPUT_COLUMNS

    if not text:
        return []
    names = [c.strip() for c in text.split(",")]
    bad = [c for c in names if not c] or [c for c in names if names.count(c) > 1]
    if bad:
        raise ConfigError(f"--keep-columns {text!r}: an empty or repeated column name; give names like id,user")
    taken = [c for c in names if c in OUTPUT_COLUMNS]
    if taken:
        raise ConfigError(
            f"--keep-columns: {', '.join(taken)} is an output column already ({', '.join(OUTPUT_COLUMNS)}); "
            "the label is written as 'label'"
        )
    return names


def cmd_predict(args: argparse.Namespace) -> int:
    _quiet_third_party()
    from recsys_dist.serve.export import load, score, write_predictions

    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise ConfigError(
            f"--out {out}: {'is a directory' if out.is_dir() else f'folder {out.parent} does not exist'}; "
            "give a file path such as preds.parquet in an existing folder"
        )
    keep = _keep_columns(args.keep_columns)
    m = load(_model_path(args))
    scores = score(m.cfg, m.model, args.data, preprocessing=m.preprocessing, keep_columns=keep)
    write_predictions(scores, args.out)
    print(f"recsys-dist: {len(scores['logit'])} predictions from {m.source} -> {args.out}")
    for f, st in scores.get("managed", {}).get("managed", {}).items():  # ids without a row are counted, never silent
        print(f"  managed {f}: {st['default_share'] or 0:.2%} of lookups read the default row (id not in the table)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run benchmarks/run.py of the source checkout this package was imported from."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
    if not script.is_file():
        print(
            f"recsys-dist bench: {script} not found; the benchmarks ship with the source checkout "
            "(git clone the repository and run it from there)",
            file=sys.stderr,
        )
        return 2
    cmd = [
        sys.executable,
        str(script),
        "--device",
        args.device,
        "--deepctr-python",
        args.deepctr_python,
        "--model",
        args.model,
    ] + (["--quick"] if args.quick else [])
    for flag in ("reps", "skip", "mlperf_max_rows", "batch", "copies"):
        if getattr(args, flag):
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return subprocess.run(cmd).returncode


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a 0 would otherwise read as "use the default")."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recsys-dist", description="Embedding-parallel CTR training.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train and evaluate a model from a YAML config")
    p.add_argument("--config", required=True, help="YAML run config, e.g. configs/criteo_quickstart.yaml")
    p.add_argument("--run-dir", default=None, help="output directory (default runs/<config>-<time>)")
    p.add_argument(
        "--profile", action="store_true", help="write a torch.profiler trace of steps 5-7 per rank to RUN_DIR/profile/"
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="auto|latest|best|PATH",
        help="continue from a checkpoint: auto = newest intact one in --run-dir (skipping a damaged one, saying "
        "so; a fresh start when there is none); latest / best = the newest / best-validation "
        "(checkpoint.keep_best) one of --run-dir; a damaged one named is refused",
    )
    p.add_argument(
        "--resume-on-new-data",
        action="store_true",
        help="resume although the training data differs from the checkpoint's (refused otherwise); the "
        "interrupted epoch starts again from its first batch over the new data",
    )
    p.add_argument("--plan", default=None, help="reuse a placement: the plan.json of an earlier run")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.batch_size=256")
    p.set_defaults(func=train_cmd.cmd_train)

    p = sub.add_parser("plan", help="dry-run the sharding planner for any cluster (no GPUs needed)")
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("--world-size", type=int, required=True, help="total ranks")
    p.add_argument("--local-world-size", type=int, default=None, help="ranks per node (default: min(world, 8))")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda",
        help="compute device of every rank (default cuda: plan the cluster you will run on, from any machine)",
    )
    p.add_argument("--hbm-gb", type=float, default=None, help="device memory per rank (sets sharding.hbm_gb)")
    p.add_argument("--ddr-gb", type=float, default=None, help="host memory per rank (sets sharding.ddr_gb)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.batch_size=8192")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("preprocess", help="convert the config's raw data to Parquet splits (cached)")
    p.add_argument("--config", required=True, help="YAML run config (its data section)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.on_bad_row=skip")
    p.set_defaults(func=cmd_preprocess)

    p = sub.add_parser(
        "export", help="write a self-contained unsharded model (weights, config, preprocessing) from a run"
    )
    p.add_argument(
        "model", help="run directory (newest checkpoint), checkpoint directory, or best / latest with --run-dir"
    )
    p.add_argument("--run-dir", default=None, help="the run whose best / latest checkpoint MODEL names")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--format",
        choices=["safetensors", "torchscript"],
        default="safetensors",
        help="torchscript: also model.torchscript.pt + serving.json, loadable with torch alone (docs/serving.md)",
    )
    p.set_defaults(func=cmd_export)
    for name, helptext in (
        ("evaluate", "AUC / logloss / NE of a model on a data file"),
        ("predict", "write per-row predictions of a model to Parquet"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("model", help="run, checkpoint or export directory, or best / latest with --run-dir")
        p.add_argument("--run-dir", default=None, help="the run whose best / latest checkpoint MODEL names")
        p.add_argument(
            "--data",
            required=True,
            help="raw file in the model's data format (.gz ok; predict also takes files without the label "
            "column) or a converted split (a Parquet file listed by the manifest.json beside it)",
        )
        if name == "predict":
            p.add_argument("--out", required=True, help="output file: Parquet, or CSV when it ends in .csv")
            p.add_argument(
                "--keep-columns",
                default=None,
                metavar="A,B",
                help="raw input columns to copy into the output (e.g. ids), by name",
            )
        p.set_defaults(func=cmd_evaluate if name == "evaluate" else cmd_predict)

    p = sub.add_parser(
        "bench",
        help="throughput vs peers and the hardware limit, one table of ratios (benchmarks/run.py of a source checkout)",
    )
    p.add_argument("--quick", action="store_true", help="under 3 minutes on 2 cores")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--deepctr-python",
        default="/tmp/dctr/bin/python",
        help="python of a venv with deepctr-torch (skipped when absent)",
    )
    p.add_argument("--reps", type=positive_int, default=None, help="interleaved rounds (default 3 quick, 5 full)")
    p.add_argument("--skip", default="", help="items to leave out, e.g. 3,5")
    p.add_argument(
        "--model",
        choices=["auto", "dlrm", "mlperf"],
        default="auto",
        help="mlperf: the GPU run's MLPerf DLRMv2 path, on any device (auto: mlperf on CUDA)",
    )
    p.add_argument("--mlperf-max-rows", type=positive_int, default=None, help="rows cap of each MLPerf table")
    p.add_argument("--batch", type=positive_int, default=None, help="per-rank batch")
    p.add_argument("--copies", type=positive_int, default=None, help="times the Criteo sample is repeated")
    p.set_defaults(func=cmd_bench)

    from recsys_dist.cli import report

    report.register_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Dotted overrides may come before or after options (argparse alone accepts one run).
    args, rest = parser.parse_known_args(argv)
    extra = [r for r in rest if "=" in r and not r.startswith("-")]
    if len(extra) != len(rest) or (extra and not hasattr(args, "overrides")):
        parser.error(
            f"unrecognized arguments: {' '.join(r for r in rest if r not in extra or not hasattr(args, 'overrides'))}"
        )
    if extra:
        args.overrides = list(args.overrides) + extra
    if getattr(args, "world_size", None) is not None:
        if args.world_size <= 0 or (args.local_world_size is not None and args.local_world_size <= 0):
            print("recsys-dist: --world-size and --local-world-size must be > 0", file=sys.stderr)
            return 2
        args.local_world_size = args.local_world_size or min(args.world_size, 8)
    try:
        return args.func(args)
    except _user_errors() as err:
        from recsys_dist.errors import DataError

        prefix = (
            "bad input data: "
            if isinstance(err, DataError)
            else "training stopped: "
            if isinstance(err, FloatingPointError)
            else ""
        )
        print(f"recsys-dist: {prefix}{err}", file=sys.stderr)
        return 2 if isinstance(err, ConfigError) else 1


if __name__ == "__main__":
    run()
