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
import signal
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.config.base import ConfigError
from recsys_dist.config.loader import load_config
from recsys_dist.train.pipelines import pipeline_problems
from recsys_dist.train.preflight import check_before_launch


def _quiet_third_party() -> None:
    # TorchRec and torch.fx warn on every run about internals a user cannot act on.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("torch.fx._symbolic_trace", "torchrec", "torch.distributed", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _print_summary(summary: dict) -> None:
    def fmt(x):
        return "n/a" if x is None else f"{x:.4f}"

    if summary.get("already_complete"):
        print("\n" + run_dirs.nothing_to_train(summary["run_dir"], summary["resumed_from"], summary["steps"]))
        return
    v, t = summary["validation"] or {}, summary["test"] or {}
    resumed = summary.get("resumed_at_step")
    print(
        f"\nrecsys-dist: trained {summary['rows_trained']} samples in {summary['steps']} steps on "
        f"{summary['world_size']} rank{'s' if summary['world_size'] != 1 else ''}, {summary['samples_per_s']} samples/s"
        + (f" (resumed at step {resumed})" if resumed is not None else "")
        + "\n"
        + _split_lines(v, t, fmt)
        + _retrieval_lines(v, t, fmt)
        + f"  run directory: {summary['run_dir']}"
    )
    best = summary.get("best")
    if best:
        print(
            f"  best validation {best['metric']} {fmt(best['value'])} at step {best['step']}"
            + (" (stopped early)" if best["early_stopped"] else "")
            + (f": {best['checkpoint']} (`best`)" if best.get("checkpoint") else "")
        )


def _retrieval_lines(v: dict, t: dict, fmt) -> str:
    """recall@K / NDCG@K of a retrieval model (and the most-popular baseline's), per split."""
    ks = sorted({int(k.split("@")[1]) for k in [*v, *t] if k.startswith("recall@")})
    lines = ""
    for split, m in (("validation", v), ("test", t)):
        for k in ks:
            lines += (
                f"  {split:<11} recall@{k} {fmt(m.get(f'recall@{k}'))}  NDCG@{k} {fmt(m.get(f'ndcg@{k}'))}  "
                f"(most popular: recall@{k} {fmt(m.get(f'popular_recall@{k}'))}  NDCG@{k} {fmt(m.get(f'popular_ndcg@{k}'))})\n"
            )
    return lines


def _split_lines(v: dict, t: dict, fmt) -> str:
    """The validation and test lines: AUC / logloss, or per task (several tasks) its metrics."""
    task_keys = [k for k in v if "/" in k] or [k for k in t if "/" in k]
    if not task_keys:
        return (
            f"  validation  AUC {fmt(v['auc'])}  logloss {fmt(v['logloss'])}\n"
            f"  test        AUC {fmt(t['auc'])}  logloss {fmt(t['logloss'])}\n"
        )
    names = list(dict.fromkeys(k.split("/")[0] for k in task_keys))
    shown = {"auc": "AUC", "logloss": "logloss", "rmse": "RMSE", "mae": "MAE"}
    lines = ""
    for split, m in (("validation", v), ("test", t)):
        for name in names:
            parts = [f"{label} {fmt(m.get(f'{name}/{k}'))}" for k, label in shown.items() if f"{name}/{k}" in m]
            lines += f"  {split:<11} {name}: {'  '.join(parts)}\n"
    return lines


def cmd_train(args: argparse.Namespace) -> int:
    """``recsys-dist train``: check the config and the run directory, then train in this process
    (one rank, or one of torchrun's ranks) or start ``distributed.nproc_per_node`` ranks."""
    from recsys_dist.distributed.env import under_launcher

    cfg = load_config(args.config, _train_overrides(args))
    if args.resume_on_new_data and not args.resume:
        raise ConfigError("--resume-on-new-data goes with --resume (it allows resuming a checkpoint on other data)")
    worker = args.worker or under_launcher()
    if not worker and cfg.distributed.nproc_per_node > 1 and start_method(cfg) == "fork":
        # The ranks fork from this process, and an OpenMP pool started here would hang
        # theirs: this process computes on one thread (set before any tensor work).
        import torch

        torch.set_num_threads(1)
    job_size = int(os.environ["WORLD_SIZE"]) if under_launcher() else None  # torchrun's, else nproc_per_node
    check_before_launch(cfg, job_size, memory=not args.worker)  # our ranks: the launcher checked
    _quiet_third_party()
    run_dir = Path(args.run_dir) if args.run_dir else run_dirs.default_run_dir(args.config)
    if worker:
        from recsys_dist.distributed.env import die_with_launcher

        die_with_launcher()  # a rank never outlives its launcher
        # The checksums are verified once: by our launcher (inherited), else by the Trainer's
        # rank 0, which also makes --resume auto's fallback past a damaged checkpoint.
        resume = _resolve_resume(args, run_dir, verify=False)
        if resume is not None and args.resume != "auto":
            run_dirs.check_resumable(cfg, resume, job_size)
        # Under torchrun (no launcher of ours) the Trainer's rank 0 takes the run directory.
        return _train_worker(args, cfg, run_dir, "auto" if args.resume == "auto" else resume)
    # One run per directory: held until this process ends, however it ends (the ranks it
    # starts see that their launcher holds it).
    with run_dirs.lock_run_dir(run_dir) or nullcontext():
        resume = _resolve_resume(args, run_dir)
        if not args.resume:
            run_dirs.check_unused(run_dir)
        if resume is not None:
            run_dirs.check_resumable(cfg, resume)
        return _launch_run(args, cfg, run_dir, resume)


def _launch_run(args: argparse.Namespace, cfg, run_dir: Path, resume: Path | None) -> int:
    """The launcher's part of ``recsys-dist train``: convert the data, then train here (one
    rank) or start the ranks; exit code."""
    # A resumed run's config.yaml is replaced only once there is something to train, so a
    # no-op resume with other overrides leaves the file that matches the checkpoints.
    run_dirs.write_config(cfg, run_dir, write=resume is None)
    t_data = time.perf_counter()
    prepared = _prepare_data(cfg)  # before any rank exists, so bad input is reported once and early
    t_data = time.perf_counter() - t_data
    if resume is not None:
        from recsys_dist.checkpoint.meta import read_meta
        from recsys_dist.data.loader import steps_per_epoch

        n = cfg.distributed.nproc_per_node
        per_epoch = steps_per_epoch(prepared.rows["train"], cfg.train.batch_size, n, cfg.data.remainder)
        meta = read_meta(resume)
        identity = run_dirs.data_identity(prepared.directory, cfg.data.raw_path)
        new_data = run_dirs.check_same_data(resume, meta, identity, args.resume_on_new_data, "--resume-on-new-data")
        offset = run_dirs.resume_position(meta, per_epoch, new_data, cfg.train.batch_size * n)[1]
        total = run_dirs.total_steps(cfg, per_epoch, offset)
        step = run_dirs.checkpoint_step(resume)
        if step >= total:
            print(run_dirs.nothing_to_train(run_dir, resume, step, total))
            return 0
        run_dirs.write_config(cfg, run_dir)
    try:
        with _run_clock(t_data):
            if cfg.distributed.nproc_per_node == 1:
                from recsys_dist.train.trainer import Trainer

                with _signals_stop():
                    profile = run_dir / "profile" if args.profile else None
                    with Trainer(
                        cfg, run_dir, resume=resume, profile_dir=profile, resume_on_new_data=args.resume_on_new_data
                    ) as trainer:
                        summary = trainer.fit()
            else:
                summary = _launch_ranks(args, cfg, run_dir, resume)
                if summary is None:
                    return 1
    except Stopped as stop:
        print(
            f"recsys-dist: stopped by {signal.Signals(stop.signum).name}; every rank was stopped. Continue with "
            f"--resume auto --run-dir {run_dir} (from its newest complete checkpoint)",
            file=sys.stderr,
        )
        return 128 + stop.signum
    _print_summary(summary)
    return 0


@contextmanager
def _run_clock(data_seconds: float):
    """The ranks' wall-time split (summary.json) starts at this command's start and counts its
    data preparation: both travel in the environment, which the ranks inherit."""
    from recsys_dist.train.observe import EARLIER_PHASES_ENV, RUN_START_ENV, process_start_time

    saved = {k: os.environ.get(k) for k in (RUN_START_ENV, EARLIER_PHASES_ENV)}
    os.environ[RUN_START_ENV] = repr(process_start_time())
    os.environ[EARLIER_PHASES_ENV] = json.dumps({"data": data_seconds})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Stopped(BaseException):
    """SIGTERM / SIGINT / SIGHUP reached the launcher (a BaseException, as KeyboardInterrupt is,
    so no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_stop():
    """SIGTERM / SIGINT / SIGHUP raise :class:`Stopped` here (the one-rank run in this process)."""

    def stop(signum, frame):
        raise Stopped(signum)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _train_overrides(args: argparse.Namespace) -> list[str]:
    """The dotted overrides, plus ``--plan FILE`` as ``sharding.fixed_plan``.

    Raises:
        ConfigError: the plan file cannot be read.
    """
    overrides = list(args.overrides)
    if args.plan:
        from recsys_dist.distributed.plan_io import load_plan_file

        try:
            fixed = load_plan_file(args.plan)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        overrides.append(f"sharding.fixed_plan={json.dumps(fixed)}")
    return overrides


def _resolve_resume(args: argparse.Namespace, run_dir: Path, verify: bool = True) -> Path | None:
    """``--resume auto|PATH`` -> a complete checkpoint directory (or None); with ``verify``
    one whose files match their checksums (``auto`` falls back past damaged ones, saying so).

    Raises:
        ConfigError: ``--resume auto`` without ``--run-dir``.
        CheckpointError: PATH is not a complete checkpoint, or is damaged (``run_dir.resolve_resume``).
    """
    if args.resume in ("auto", "best", "latest") and not args.run_dir:
        raise ConfigError(f"--resume {args.resume} continues a run: give its directory with --run-dir")
    path = run_dirs.resolve_resume(args.resume, run_dir, verify=verify)
    if args.resume == "auto" and path is None and verify:
        # Lets one job script serve the first submission and every requeue.
        print(
            f"recsys-dist: --resume auto: no complete checkpoint in {run_dir / 'checkpoints'} yet; "
            "starting from scratch",
            file=sys.stderr,
        )
    return path


def _prepare_data(cfg):
    """Convert the raw data (cached); returns the ``PreparedData``.

    Raises:
        DataError: bad input, or an empty training split.
    """
    from recsys_dist.data.config import describe_raw_path
    from recsys_dist.data.resolve import prepare_from_config
    from recsys_dist.errors import DataError

    prepared = prepare_from_config(cfg, progress=sys.stderr.isatty())
    if prepared.rows["train"] == 0:
        rows = ", ".join(f"{k} {v}" for k, v in prepared.rows.items())
        raise DataError(
            f"{describe_raw_path(cfg.data.raw_path)}: the training split is empty ({rows} rows); give more rows or "
            "change data.split"
        )
    return prepared


def _train_worker(args: argparse.Namespace, cfg, run_dir: Path, resume: Path | str | None) -> int:
    """One rank under a launcher (``launch_workers``' hidden ``--worker``, or torchrun)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from recsys_dist.checkpoint.meta import latest_checkpoint
    from recsys_dist.train.trainer import train

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        # The elastic agent restarted the group after a failure: continue from the newest
        # intact checkpoint of this run, if one was written.
        resume = "auto" if latest_checkpoint(run_dir) is not None else resume
    try:
        summary = record(train)(
            cfg, run_dir, run_dir / "profile" if args.profile else None, resume, args.resume_on_new_data
        )
    except _user_errors() as err:
        # Recorded for the launcher's report already; a traceback would only bury the message.
        # An error every rank raised together (a full disk, a read-only file system) is
        # printed once: by our launcher (--worker), else by rank 0.
        rank = int(os.environ.get("RANK", 0))
        if not (getattr(err, "every_rank", False) and (args.worker or rank != 0)):
            print(f"recsys-dist [rank {rank}]: {err}", file=sys.stderr)
        sys.stderr.flush()
        return 1
    if summary and not args.worker and int(os.environ.get("RANK", 0)) == 0:
        _print_summary(summary)
    # Everything is written and the process group is gone. The callers (``run``, the
    # launcher's ``cli_rank``) leave without interpreter finalisation: a native thread torn
    # down there aborted a finished worker with SIGABRT in about 1 run in 40.
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def _launch_ranks(args: argparse.Namespace, cfg, run_dir: Path, resume: Path | None) -> dict | None:
    """Start ``distributed.nproc_per_node`` ranks of ``recsys-dist train``; the run's summary,
    or None after printing the first failing rank's error."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from recsys_dist.train import rank_failure
    from recsys_dist.train.launch import failure_message, first_failure, launch_workers

    # The elastic agent's own handlers turn SIGTERM / SIGINT / SIGHUP into SignalException
    # once the ranks run; it stops them (SIGTERM, then SIGKILL) before raising it.
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    oom_before = rank_failure.oom_kills()
    try:
        extra = (["--profile"] if args.profile else []) + (["--resume", str(resume)] if resume else [])
        extra += ["--resume-on-new-data"] if args.resume_on_new_data else []
        with _signals_stop():
            launch_workers(
                cli_rank,
                run_dir,
                cfg.distributed.nproc_per_node,
                cfg.distributed.max_restarts,
                extra,
                start_method(cfg),
            )
    except SignalException as err:
        raise Stopped(int(err.sigval)) from None
    except ChildFailedError as err:
        rank, first = first_failure(err)
        text = rank_failure.describe(
            rank,
            first,
            failure_message(first),
            oom_file=rank_failure.oom_rose(oom_before, rank_failure.oom_kills()),
            cfg=cfg,
            run_dir=run_dir,
            resume_command=rank_failure.resume_command(args, run_dir),
        )
        print(text, file=sys.stderr)
        return None
    return run_dirs.read_summary(run_dir)


_ENTRY_POINT = False  # set by run(): this process is the recsys-dist command


def start_method(cfg) -> str:
    """How ``recsys-dist train`` starts its ranks: ``distributed.start_method``, where ``auto``
    is ``fork`` on CPU when this process is the ``recsys-dist`` command, else ``spawn``.

    Raises:
        ConfigError: ``fork`` with a CUDA device (CUDA does not survive a fork).
    """
    from recsys_dist.distributed.env import resolve_device

    cuda = resolve_device(cfg.distributed.device).type == "cuda"
    method = cfg.distributed.start_method
    if method == "auto":
        # Only a process that `recsys-dist` itself started is known to hold no OpenMP pool
        # (see cmd_train); called from other Python code, main() spawns.
        return "fork" if _ENTRY_POINT and not cuda else "spawn"
    if method == "fork" and cuda:
        raise ConfigError(
            "distributed.start_method: fork cannot start CUDA ranks (CUDA does not survive a fork); use spawn or auto"
        )
    return method


LOST_PEER_GRACE_S = 5.0  # how long a rank that lost its peer waits before it exits (cli_rank)


def cli_rank(argv: list[str]) -> int:
    """What every rank of ``recsys_dist.train.launch.launch_workers`` runs: ``recsys-dist <argv>`` in this process.

    A failed rank leaves with its exit code (the agent reports it with the error the rank
    recorded); a finished one returns 0 to the agent."""
    import signal

    # A forked rank inherits the launcher's handlers (the agent's SIGTERM -> SignalException).
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import traceback

    from torch.distributed.elastic.multiprocessing.errors import record

    from recsys_dist.train.rank_failure import lost_peer

    try:
        code = record(main)(argv)  # an exception is recorded (error.json) for the launcher
    except BaseException as err:  # noqa: BLE001 - leave now, so this rank is the one the launcher sees fail first
        if isinstance(err, KeyboardInterrupt):  # the launcher's SIGINT, passed on: it says so in one line
            os._exit(130)
        if lost_peer(err):  # the effect of another rank's end, which the launcher reports: one line
            # Wait for the launcher to see that rank's end first (it stops this one meanwhile):
            # the elastic agent reports one failed rank, whichever it finds first, and a rank
            # killed by a signal records no error, so this rank's error would hide the cause.
            time.sleep(LOST_PEER_GRACE_S)
            first_line = str(err).splitlines()[0] if str(err) else ""
            rank = os.environ.get("RANK", "?")
            print(
                f"recsys-dist: rank {rank} stopped: it lost its connection to another rank ({first_line})",
                file=sys.stderr,
            )
        else:
            traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    return 0


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
    global _ENTRY_POINT
    _ENTRY_POINT = True
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
    if args.local_world_size > args.world_size or args.world_size % args.local_world_size:
        raise ConfigError(f"--local-world-size {args.local_world_size} must divide --world-size {args.world_size}")
    _quiet_third_party()
    logging.getLogger().setLevel(logging.ERROR)  # the planner logs through the root logger
    from recsys_dist.distributed.dry_run import PlanError, dry_run

    try:
        pipeline = pipeline_problems(cfg.train.pipeline, args.device)
        report = dry_run(cfg, args.world_size, args.local_world_size, args.device, pipeline)
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
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.batch_size=256")
    p.set_defaults(func=cmd_train)

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
