"""The run directory's policy, shared by the ``recsys-dist train`` command and :class:`Trainer`.

A run directory holds one run (the README's table: ``config.yaml``, ``plan.txt`` /
``plan.json``, ``metrics.jsonl``, ``summary.json``, ``checkpoints/``). The rules:

- a directory that already holds a run (``metrics.jsonl`` or ``checkpoints/``) is refused
  unless the run is resumed, so two runs are never mixed (:func:`check_unused`);
- ``resume`` is ``"auto"`` (the newest complete checkpoint of the run directory, or none
  yet) or a path: a checkpoint directory, or a run directory meaning its newest complete
  checkpoint (:func:`resolve_resume`);
- ``config.yaml`` is the resolved config; a resumed run replaces it only once there is
  something left to train, so a no-op resume leaves the file that matches the checkpoints
  (:func:`write_config`, :func:`total_steps`).

No function here needs torch or a process group.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

from recsys_dist.config import ConfigError, RunConfig, save_config

RUN_FILES = ("metrics.jsonl", "checkpoints")  # their presence means the directory holds a run


def default_run_dir(config_path: str | Path) -> Path:
    """``runs/<config stem>-<time>``; under torchrun ``runs/<config stem>-<run id>``, the same
    on every rank (``$TORCHELASTIC_RUN_ID``)."""
    stem = Path(config_path).stem
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    suffix = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stem}-{suffix}"


def check_unused(run_dir: Path) -> None:
    """Refuse a directory that already holds a run.

    Raises:
        ConfigError: ``run_dir`` holds ``metrics.jsonl`` or ``checkpoints/``.
    """
    used = [n for n in RUN_FILES if (Path(run_dir) / n).exists()]
    if used:
        raise ConfigError(
            f"--run-dir {run_dir} already holds a run ({', '.join(used)}); continue it with "
            "--resume auto, or give a new --run-dir (runs are never mixed or overwritten)"
        )


def resolve_resume(resume: str | Path | None, run_dir: Path, flag: str = "--resume") -> Path | None:
    """``resume`` -> a complete checkpoint directory, or None (nothing to resume from).

    Args:
        resume: None; ``"auto"``: the newest complete checkpoint in ``run_dir`` (None when
            there is none yet, so one job script serves the first submission and every
            requeue); a checkpoint directory (``step_N``); or a run directory, meaning its
            newest complete checkpoint.
        run_dir: the run's directory (for ``"auto"``).
        flag: how messages name the option (``--resume`` on the command line).

    Raises:
        CheckpointError: the path is a file, does not exist, is an incomplete checkpoint,
            or is a run directory without a complete checkpoint.
    """
    from recsys_dist.checkpoint import CheckpointError, latest_checkpoint, read_meta

    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(Path(run_dir))
    path = Path(resume)
    if path.is_file():
        raise CheckpointError(f"{flag} {path} is a file; give a checkpoint directory (step_N) or a run directory")
    if (path / "checkpoints").is_dir():  # a run directory: its newest complete checkpoint
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{flag} {path}: this run directory has no complete checkpoint")
        path = found
    read_meta(path)  # raises CheckpointError naming what is wrong
    return path


def check_resumable(cfg: RunConfig, checkpoint: Path) -> None:
    """Refuse a checkpoint written by another model config (before any rank starts).

    Table sizes are compared only when they come from the config (hash mapping); sizes
    from a vocabulary are known once the data is converted.

    Raises:
        CheckpointError: naming each differing key, old -> new.
    """
    from recsys_dist.checkpoint import check_compatible, read_meta

    check_compatible(checkpoint, read_meta(checkpoint), cfg.to_dict(), tables=cfg.data.categorical_mapping == "hash")


def checkpoint_step(checkpoint: Path) -> int:
    """The step a complete checkpoint was written at (from its ``meta.json``)."""
    from recsys_dist.checkpoint import read_meta

    return int(read_meta(checkpoint)["step"])


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """Steps the run trains in all: ``train.epochs`` epochs, capped by ``train.max_steps``."""
    total = cfg.train.epochs * steps_per_epoch
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def write_config(cfg: RunConfig, run_dir: Path, write: bool = True) -> None:
    """Create ``run_dir`` and, if ``write``, its ``config.yaml`` (what launched ranks read).

    Raises:
        ConfigError: the directory cannot be created or written.
    """
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if write:
            save_config(cfg, run_dir / "config.yaml")
        elif not os.access(run_dir, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as err:
        raise ConfigError(
            f"--run-dir {run_dir}: cannot write there ({err.strerror}); choose a writable directory"
        ) from None


def read_summary(run_dir: Path) -> dict:
    """``summary.json`` of a finished run, or ``{}`` when there is none."""
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}
