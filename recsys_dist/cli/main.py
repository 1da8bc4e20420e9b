"""``recsys-dist`` command line: the parser, and the dispatch to each command's module.

recsys-dist train --config configs/criteo_quickstart.yaml [--run-dir DIR] [key=value ...]
recsys-dist plan --config configs/mlperf_dlrmv2.yaml --world-size 64 --local-world-size 8 --hbm-gb 80
recsys-dist report RUN_DIR          (summary table + PNG plots in RUN_DIR)
recsys-dist compare RUN_A RUN_B
recsys-dist serve EXPORT_OR_PUBLISH_DIR --port 8000   (HTTP scoring, hot reload)
recsys-dist bench [--quick]     (benchmarks/run.py: ratios vs peers and the hardware limit)

This module imports no torch: every command's arguments are declared here, and its module
(``COMMANDS``) is imported only when it runs, so ``--help`` and a usage error answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from collections.abc import Callable

from recsys_dist.errors import USER_ERRORS, ConfigError, DataError
from recsys_dist.logs import dump_stacks_on_sigusr1, print_apart


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a 0 would otherwise read as "use the default")."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def python_command(text: str) -> str:
    """argparse type: a program to run, as a path or a command on PATH; its path (shutil.which).
    Used for ``--deepctr-python``, which has no default: a machine's venv path is no default."""
    found = shutil.which(text)
    if found is None:
        raise argparse.ArgumentTypeError(
            f"{text} is neither an executable file nor a command on PATH; give the python of a venv "
            "with deepctr-torch (docs/benchmarks.md says how to make one)"
        )
    return found


def _overrides(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")


def _train_arguments(p: argparse.ArgumentParser) -> None:
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
    _overrides(p, "train.batch_size=256")


def _plan_arguments(p: argparse.ArgumentParser) -> None:
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
    _overrides(p, "train.batch_size=8192")


def _preprocess_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config (its data section)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _overrides(p, "data.on_bad_row=skip")


def _model_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("model", help=what)
    p.add_argument("--run-dir", default=None, help="the run whose best / latest checkpoint MODEL names")


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",  # or --from-publish
        default=None,
        help="run directory (newest checkpoint), checkpoint directory, or best / latest with --run-dir",
    )
    p.add_argument("--run-dir", default=None, help="the run whose best / latest checkpoint MODEL names")
    p.add_argument(
        "--from-publish", default=None, metavar="DIR", help="instead of MODEL: fold the versions published in DIR"
    )
    p.add_argument(
        "--version",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --from-publish: fold version N (default: the latest; if it cannot be loaded, the newest intact "
        "one, with a warning)",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--format",
        choices=["safetensors", "torchscript"],
        default=None,
        help="torchscript: also model.torchscript.pt + serving.json, loadable with torch alone (docs/serving.md); "
        "default safetensors (--from-publish: the publish's publish.format)",
    )


def _evaluate_arguments(p: argparse.ArgumentParser) -> None:
    _model_argument(p, "run, checkpoint or export directory, or best / latest with --run-dir")
    p.add_argument(
        "--data",
        required=True,
        help="raw file in the model's data format (.gz ok; predict also takes files without the label "
        "column) or a converted split (a Parquet file listed by the manifest.json beside it)",
    )


def _predict_arguments(p: argparse.ArgumentParser) -> None:
    _evaluate_arguments(p)
    p.add_argument("--out", required=True, help="output file: Parquet, or CSV when it ends in .csv")
    p.add_argument(
        "--keep-columns",
        default=None,
        metavar="A,B",
        help="raw input columns to copy into the output (e.g. ids), by name",
    )


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="DIR", help="an export directory (recsys-dist export) or a publish directory")
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument(
        "--reload-seconds",
        type=float,
        default=2.0,
        help="how often DIR is checked for a new model, loaded off the request path (0: never)",
    )
    p.add_argument(
        "--version",
        type=positive_int,
        default=None,
        metavar="N",
        help="a publish directory's version N only, never reloaded (default: its latest, followed as it changes; "
        "a latest that cannot be loaded is served at its newest intact version, with a warning)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="DIR may hold no model yet (a training run's publish dir before its first publish): answer 503 "
        "until an export or a publish appears there, then serve it",
    )
    limits = p.add_argument_group("limits (docs/serving.md#limits)")
    limits.add_argument(
        "--memory-mb",
        type=float,
        default=None,
        help="memory the requests in flight may take together (estimated from their bodies and rows); a request "
        "past it gets 503 with Retry-After (default: half of the memory available at start)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="connections open at once (default 10000, or the open-files limit less 128); more: 503",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds for a request's line and headers to arrive, else its connection is closed (default 10)",
    )
    limits.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds for a request's body to arrive, else 408 (default 30)"
    )
    limits.add_argument(
        "--keep-alive", type=float, default=5.0, help="seconds an idle connection is kept open (default 5)"
    )


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="under 3 minutes on 2 cores")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--deepctr-python",
        type=python_command,
        default=None,
        help="python of a venv with deepctr-torch, a path or a command on PATH (item 3; skipped when not given)",
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


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    p.add_argument("--out", default=None, metavar="DIR", help="write the plots here (default: RUN_DIR)")
    p.add_argument("--no-plots", action="store_true", help="print the summary only")


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", metavar="RUN_A", help="baseline run directory")
    p.add_argument("run_b", metavar="RUN_B", help="run directory compared against RUN_A")


# command -> (the module defining cmd_<command>, its help line, its arguments).
COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "train": ("recsys_dist.cli.train", "train and evaluate a model from a YAML config", _train_arguments),
    "plan": ("recsys_dist.cli.plan", "dry-run the sharding planner for any cluster (no GPUs needed)", _plan_arguments),
    "preprocess": (
        "recsys_dist.cli.data",
        "convert the config's raw data to Parquet splits (cached)",
        _preprocess_arguments,
    ),
    "export": (
        "recsys_dist.cli.inference",
        "write a self-contained unsharded model (weights, config, preprocessing) from a run",
        _export_arguments,
    ),
    "evaluate": ("recsys_dist.cli.inference", "AUC / logloss / NE of a model on a data file", _evaluate_arguments),
    "predict": ("recsys_dist.cli.inference", "write per-row predictions of a model to Parquet", _predict_arguments),
    "serve": (
        "recsys_dist.cli.serve",
        "HTTP scoring server (POST /score, GET /health) that reloads the model when DIR changes",
        _serve_arguments,
    ),
    "bench": (
        "recsys_dist.cli.bench",
        "throughput vs peers and the hardware limit, one table of ratios (benchmarks/run.py of a source checkout)",
        _bench_arguments,
    ),
    "report": (
        "recsys_dist.cli.report",
        "summarise a run directory and write PNG plots into it",
        _report_arguments,
    ),
    "compare": ("recsys_dist.cli.report", "two run directories side by side, with deltas", _compare_arguments),
}


def build_parser() -> argparse.ArgumentParser:
    """Every command's arguments; the parsed namespace's ``command`` names the one to run."""
    parser = argparse.ArgumentParser(prog="recsys-dist", description="Embedding-parallel CTR training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, helptext, add_arguments) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=helptext))
    return parser


def command(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs command ``name`` (``cmd_<name>`` of its module in ``COMMANDS``).

    The one place a command's module is imported: by name, when the command runs, so that
    torch (which most of them import) loads only after the arguments parsed."""
    return getattr(importlib.import_module(COMMANDS[name][0]), f"cmd_{name}")


def main(argv: list[str] | None = None) -> int:
    """Run ``recsys-dist ARGV``; its exit code: 0, 1 for a failure, 2 for a config error.

    A user error (``USER_ERRORS``) is printed as one line; a usage error leaves through
    argparse's ``SystemExit`` (2)."""
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
    try:
        return command(args.command)(args)
    except USER_ERRORS as err:
        prefix = (
            "bad input data: "
            if isinstance(err, DataError)
            else "training stopped: "
            if isinstance(err, FloatingPointError)
            else ""
        )
        print_apart(f"recsys-dist: {prefix}{err}")  # below this process's progress bar, if one is drawn
        return 2 if isinstance(err, ConfigError) else 1


def run(argv: list[str] | None = None) -> None:
    """Console entry point: ``main(argv)`` (default: the command line), then leave without
    interpreter finalisation, which aborted ~1 run in 5 with SIGABRT when a native (pyarrow /
    torch) thread was still being torn down after an error had already been reported. Never
    returns; a usage error leaves through argparse's ``SystemExit``."""
    dump_stacks_on_sigusr1()  # kill -USR1: where a run that seems stuck waits
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # Through the module's imported copy: one copy of its state, the one the command modules import.
    importlib.import_module("recsys_dist.cli.main").run()
