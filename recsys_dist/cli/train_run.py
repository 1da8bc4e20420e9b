"""``recsys-dist train`` after its config loaded (``recsys_dist.cli.train``): resolve the Job once,
check it, take the run directory, convert the data, then train here (one rank) or start the ranks
(``recsys_dist.train.worker``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.config.job import resolve_job
from recsys_dist.config.run import RunConfig
from recsys_dist.distributed.config import DistributedConfig
from recsys_dist.distributed.env import die_with_launcher, resolve_device, under_launcher
from recsys_dist.errors import ConfigError
from recsys_dist.logs import print_apart, quiet_third_party
from recsys_dist.serve.publish_callback import PublishCallback, check_publish_dir
from recsys_dist.train import rank_failure
from recsys_dist.train.config import PublishConfig
from recsys_dist.train.job import Job, prepare_data
from recsys_dist.train.launch import start_forkserver
from recsys_dist.train.preflight import check_before_launch, check_converted, check_resumable
from recsys_dist.train.run import train
from recsys_dist.train.summary import print_summary
from recsys_dist.train.worker import (
    RankRun,
    Stopped,
    launch_ranks,
    nothing_to_train,
    run_clock,
    signals_stop,
    stopped_message,
    train_rank,
)


def run_train(args: argparse.Namespace, cfg: RunConfig) -> int:
    """``recsys-dist train`` once its config ``cfg`` is loaded (``recsys_dist.cli.train``): the
    launcher, or one of torchrun's ranks (each runs this command)."""
    quiet_third_party()  # before the checks below build the model
    torchrun = under_launcher()
    if not torchrun and cfg.distributed.nproc_per_node > 1 and start_method(cfg.distributed) == "fork":
        # The ranks fork from this process, and an OpenMP pool started here would hang
        # theirs: this process computes on one thread (set before any tensor work).
        torch.set_num_threads(1)
    job = resolve_job(cfg, world_size=int(os.environ["WORLD_SIZE"]) if torchrun else None)
    check_before_launch(job)  # every problem at once, before the run directory or any rank
    run_dir = Path(args.run_dir) if args.run_dir else run_dirs.default_run_dir(args.config)
    if torchrun:
        return _torchrun_rank(args, job, run_dir)
    # One run per directory: held until this process ends, however it ends (the ranks it
    # starts see that their launcher holds it).
    with run_dirs.lock_run_dir(run_dir) or nullcontext():
        resume = _resolve_resume(args, run_dir)
        if not args.resume:
            run_dirs.check_unused(run_dir)
        if resume is not None:
            check_resumable(job, resume)
        check_publish_dir(job.publish, run_dir, resumed=resume is not None)
        return _launch_run(args, job, run_dir, resume)


def _torchrun_rank(args: argparse.Namespace, job: Job, run_dir: Path) -> int:
    """One of torchrun's ranks (no launcher of ours): the Trainer's rank 0 takes the run directory."""
    die_with_launcher()  # a rank never outlives its launcher
    # The checksums are verified once, by the Trainer's rank 0, which also makes --resume
    # auto's fallback past a damaged checkpoint.
    resume = _resolve_resume(args, run_dir, verify=False)
    if resume is not None and args.resume != "auto":
        check_resumable(job, resume, job.world.size)
    run = RankRun(
        run_dir,
        args.profile,
        "auto" if args.resume == "auto" else resume,
        args.resume_on_new_data,
        False,
        plugins(job.publish, run_dir),
    )
    code, summary = train_rank(job, run)
    if summary and int(os.environ.get("RANK", 0)) == 0:
        print_summary(summary)
    return code


def _launch_run(args: argparse.Namespace, job: Job, run_dir: Path, resume: Path | None) -> int:
    """The launcher's part: convert the data, then train here (one rank) or start the ranks; exit code."""
    # A resumed run's config.yaml is replaced only once there is something to train, so a
    # no-op resume with other overrides leaves the file that matches the checkpoints.
    run_dirs.write_config(job.to_dict(), run_dir, write=resume is None)
    if job.distributed.nproc_per_node > 1 and start_method(job.distributed) == "forkserver":
        start_forkserver()  # its imports overlap the data preparation below
    t_data = time.perf_counter()
    stream = job.data.stream is not None  # its partitions are converted by the ranks as they land
    if not stream:
        # Before any rank exists, so that bad input is reported once and early.
        job = job.with_data(prepare_data(job, progress=sys.stderr.isatty()))
        check_converted(job)  # table sizes known only now (vocabulary mapping): refused before any rank
    t_data = time.perf_counter() - t_data
    if resume is not None and not stream:
        done = nothing_to_train(job, resume, run_dir, args.resume_on_new_data)
        if done:
            print(done)
            return 0
        run_dirs.write_config(job.to_dict(), run_dir)
    run = RankRun(run_dir, args.profile, resume, args.resume_on_new_data, callbacks=plugins(job.publish, run_dir))
    launched_at = time.time()
    try:
        with run_clock(t_data):
            if job.distributed.nproc_per_node == 1:
                with signals_stop():
                    profile = run_dir / "profile" if args.profile else None
                    summary = train(job, run_dir, profile, resume, run.resume_on_new_data, run.callbacks)
            else:
                summary = launch_ranks(
                    job, run, start_method(job.distributed), rank_failure.resume_command(args, run_dir)
                )
                if summary is None:
                    return 1
    except Stopped as stop:
        summary = _stream_stopped(run_dir, launched_at) if stream else None
        bars = job.distributed.nproc_per_node > 1 and job.train.progress_bar  # rank 0's, maybe cut off mid-line
        if summary is None:
            print_apart(stopped_message(stop, run_dir), other_bar=bars)
            return 128 + stop.signum
        # A stream's ranks stop on SIGTERM after a checkpoint: a clean end (docs/online.md).
        print_apart("recsys-dist: SIGTERM: the stream stopped after a checkpoint", other_bar=bars)
    print_summary(summary)
    return 0


def plugins(publish: PublishConfig, run_dir: Path) -> tuple:
    """The Trainer callbacks the config asks for: the publisher of ``publish:`` (serve layer)."""
    return (PublishCallback(publish, run_dir),) if publish.enabled else ()


def _stream_stopped(run_dir: Path, since: float) -> dict | None:
    """The summary a stream's ranks wrote when SIGTERM stopped them cleanly (after ``since``),
    or None."""
    path = run_dir / "summary.json"
    if not path.is_file() or path.stat().st_mtime < since:
        return None
    summary = run_dirs.read_summary(run_dir)
    return summary if summary.get("stopped") == "SIGTERM" else None


def start_method(distributed: DistributedConfig) -> str:
    """How ``recsys-dist train`` starts its ranks: ``distributed.start_method``, where ``auto``
    is ``forkserver`` on CPU and ``spawn`` on CUDA.

    Raises:
        ConfigError: ``fork`` with a CUDA device (CUDA does not survive a fork).
    """
    cuda = resolve_device(distributed.device).type == "cuda"
    method = distributed.start_method
    if method == "auto":
        return "spawn" if cuda else "forkserver"
    if method == "fork" and cuda:
        raise ConfigError(
            "distributed.start_method: fork cannot start CUDA ranks (CUDA does not survive a fork); use spawn or auto"
        )
    return method


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
