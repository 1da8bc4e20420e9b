"""``recsys-dist train``: check the config and the run directory, convert the data, then train
in this process (one rank) or start ``distributed.nproc_per_node`` ranks.

Moved here from ``cli/main.py`` unchanged but for its imports (the train path's rework replaces it).
Its top-level imports load no torch, so that a config error answers before torch loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.cli import main as cli_main
from recsys_dist.cli.main import USER_ERRORS
from recsys_dist.cli.main import quiet_third_party as _quiet_third_party
from recsys_dist.cli.summary import print_summary as _print_summary
from recsys_dist.config.base import ConfigError
from recsys_dist.config.loader import load_config


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
    from recsys_dist.train.preflight import check_before_launch  # torch loads once the config is valid

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
        from recsys_dist.checkpoint.dcp import read_meta
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
        from recsys_dist.distributed.sharding import load_plan_file

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
    from recsys_dist.data.criteo import DataError
    from recsys_dist.data.resolve import prepare_from_config

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

    from recsys_dist.checkpoint.dcp import latest_checkpoint
    from recsys_dist.train.trainer import train

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        # The elastic agent restarted the group after a failure: continue from the newest
        # intact checkpoint of this run, if one was written.
        resume = "auto" if latest_checkpoint(run_dir) is not None else resume
    try:
        summary = record(train)(
            cfg, run_dir, run_dir / "profile" if args.profile else None, resume, args.resume_on_new_data
        )
    except USER_ERRORS as err:
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
        return "fork" if cli_main.ENTRY_POINT and not cuda else "spawn"
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
        code = record(cli_main.main)(argv)  # an exception is recorded (error.json) for the launcher
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
