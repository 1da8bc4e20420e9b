"""The run directory's policy, shared by the ``recsys-dist train`` command and :class:`Trainer`.

A run directory holds one run (the README's table: ``config.yaml``, ``plan.txt`` /
``plan.json``, ``metrics.jsonl``, ``summary.json``, ``checkpoints/``). The rules:

- a directory that already holds a run (``metrics.jsonl`` or ``checkpoints/``) is refused
  unless the run is resumed, so two runs are never mixed (:func:`check_unused`);
- ``resume`` is ``"auto"`` (the newest complete checkpoint of the run directory, or none
  yet), ``"latest"`` / ``"best"`` (the run directory's newest / best-validation checkpoint,
  which must exist) or a path: a checkpoint directory, or a run directory meaning its newest complete
  checkpoint (:func:`resolve_resume`);
- one run writes a directory at a time: the process that starts the run holds an exclusive
  lock on ``RUN_DIR/.lock`` for the run's life (:func:`lock_run_dir`), so a second run, fresh
  or ``--resume``, is refused at once, naming the holder; taking it also refuses a directory
  planted at the name of a file the run writes (:func:`check_run_files`) and removes the
  temporary files a killed run left (``.NAME.RANDOM.tmp``, :func:`remove_temporaries`);
- ``config.yaml`` is the resolved config; a resumed run replaces it only once there is
  something left to train, so a no-op resume leaves the file that matches the checkpoints
  (:func:`write_config`; the steps it trains: ``TrainConfig.total_steps``).

No function here needs torch or a process group.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from recsys_dist.checkpoint.integrity import intact_checkpoint, newest_intact_checkpoint
from recsys_dist.checkpoint.meta import latest_checkpoint, named_checkpoint, read_meta
from recsys_dist.data.config import describe_raw_path
from recsys_dist.data.convert.manifest import train_identity
from recsys_dist.errors import CheckpointError, DataChanged, RunDirLocked, UnsafeFile  # noqa: F401 (raised here; defined in errors)
from recsys_dist.files import open_in_place, refuse_planted, write_atomic
from recsys_dist.section import ConfigError

RUN_FILES = ("metrics.jsonl", "checkpoints")  # their presence means the directory holds a run
# The files a run writes (whole, by rename: recsys_dist.files.write_atomic), relative to its directory.
WRITTEN_FILES = (
    "config.yaml",
    "plan.txt",
    "plan.json",
    "summary.json",
    "metrics.jsonl",
    "checkpoints/latest",
    "checkpoints/best",
)
# recsys_dist.files.write_atomic's temporary name for NAME: .NAME.<8 hex digits>.tmp
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{8}\.tmp")


def default_run_dir(config_path: str | Path) -> Path:
    """``runs/<config stem>-<time>``; under torchrun ``runs/<config stem>-<run id>``, the same
    on every rank (``$TORCHELASTIC_RUN_ID``)."""
    stem = Path(config_path).stem
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    suffix = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stem}-{suffix}"


LOCK_FILE = ".lock"
# Set for the ranks a launcher starts: the run directory whose lock that launcher holds.
LOCK_ENV = "RECSYS_DIST_RUN_LOCK"


class RunDirLock:
    """An exclusive ``flock`` on ``RUN_DIR/.lock``; :meth:`release` (or the end of the
    process, however it ends) gives it back. ``hand_down``: the run this process starts
    (its ranks, or one rank in this process) trains under it: ``$RECSYS_DIST_RUN_LOCK`` names it."""

    # The handed-down locks this process holds, oldest first, and $RECSYS_DIST_RUN_LOCK from
    # before the first: locks may be released in any order, so the variable names the newest
    # lock still held, never one already given back.
    _held: list[RunDirLock] = []
    _env_outside: str | None = None

    def __init__(self, run_dir: Path, fd: int, hand_down: bool = True) -> None:
        self.run_dir, self._fd, self.hand_down = run_dir, fd, hand_down
        if not hand_down:
            return
        if not RunDirLock._held:
            RunDirLock._env_outside = os.environ.get(LOCK_ENV)
        RunDirLock._held.append(self)
        os.environ[LOCK_ENV] = str(run_dir)  # ranks started from here inherit it

    def release(self) -> None:
        """Give the lock back. Idempotent."""
        if self._fd is None:
            return
        os.close(self._fd)  # closing the only descriptor drops the flock
        self._fd = None
        if not self.hand_down:
            return
        RunDirLock._held.remove(self)
        env = str(RunDirLock._held[-1].run_dir) if RunDirLock._held else RunDirLock._env_outside
        if env is None:
            os.environ.pop(LOCK_ENV, None)
        else:
            os.environ[LOCK_ENV] = env

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_dir(run_dir: str | Path, wait_s: float = 0.0, hand_down: bool = True) -> RunDirLock | None:
    """Take the run directory for this run: an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock``
    (the directory is created if missing), with this process's pid, host and command
    written into the file so that a refused run can name the holder.

    The kernel drops a flock when its holder dies, however it dies (SIGKILL, power-off of a
    local disk's host), so a ``.lock`` left by a dead run never blocks anyone: it is simply
    taken over. On a network file system flock is only as good as its lock service (NFSv4:
    yes; some FUSE mounts: no).

    Args:
        run_dir: the run directory.
        wait_s: how long to wait for a holder that is going away (an elastic restart's
            previous rank 0), in seconds; 0 = refuse at once.
        hand_down: whether the run this process starts trains under this lock (``recsys-dist
            train``: its ranks, or its one rank in this process, find the directory in
            ``$RECSYS_DIST_RUN_LOCK`` and take no lock of their own). A Trainer's lock is not
            handed down: a second Trainer on the directory, in this process or one it starts,
            is refused while the first is open (flock refuses a second open of the file, even
            in the same process).

    Returns:
        The lock, or None when a launcher of this process holds it already (``$RECSYS_DIST_RUN_LOCK``
        names this directory: the ranks of ``recsys-dist train`` or of a locked ``launch``).

    Once taken, the directory is checked (:func:`check_run_files`) and the temporary files a
    killed run left are removed (:func:`remove_temporaries`).

    Raises:
        RunDirLocked: another live process holds it (naming its pid, host and command), or
            this process does (a Trainer on the directory not closed yet: close it first).
        ConfigError: the directory or its lock file cannot be created, ``.lock`` is a
            symbolic link, a hard link or not a regular file (refused: never written through),
            or a directory stands where the run writes a file (:func:`check_run_files`).
    """
    run_dir = Path(run_dir).absolute()
    if os.environ.get(LOCK_ENV) == str(run_dir):
        return None
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = open_in_place(path, os.O_RDWR | os.O_CREAT, 0o644)
    except UnsafeFile as err:
        raise ConfigError(f"--run-dir {run_dir}: {err}") from None
    except OSError as err:
        raise ConfigError(
            f"--run-dir {run_dir}: cannot write there ({err.strerror}); choose a writable directory"
        ) from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            refusal = _refusal(run_dir, path, fd)
            os.close(fd)
            raise refusal from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    info["command"] = " ".join(sys.argv)[:500]
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError:
        pass  # the lock holds without its description
    lock = RunDirLock(run_dir, fd, hand_down)
    try:
        check_run_files(run_dir)
    except ConfigError:
        lock.release()
        raise
    remove_temporaries(run_dir)
    return lock


def check_run_files(run_dir: Path) -> None:
    """Refuse a directory standing where the run writes a file (:data:`WRITTEN_FILES`, e.g. a
    ``mkdir RUN/summary.json``): checked before the run starts, since the write (by rename)
    would fail only once the run has trained.

    Raises:
        ConfigError: naming each such path and the fix (``rm -r PATH``).
    """
    problems = []
    for name in WRITTEN_FILES:
        try:
            refuse_planted(Path(run_dir) / name)
        except UnsafeFile as err:
            problems.append(str(err))
    if problems:
        raise ConfigError(f"--run-dir {run_dir}: " + "; ".join(problems))


def remove_temporaries(run_dir: Path) -> list[Path]:
    """Remove the temporary files (``.NAME.RANDOM.tmp``, :func:`recsys_dist.files.write_atomic`)
    that a run killed mid-write left in ``run_dir`` and ``run_dir/checkpoints``; the caller
    holds the run directory's lock, so no live writer owns them. Returns the paths removed."""
    removed = []
    for d in (Path(run_dir), Path(run_dir) / "checkpoints"):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            path = d / name
            if _TEMPORARY.fullmatch(name) and not path.is_dir():
                try:
                    path.unlink()
                    removed.append(path)
                except OSError:
                    pass  # left for the next run: harmless
    return removed


def _refusal(run_dir: Path, path: Path, fd: int) -> RunDirLocked:
    """The error for a run directory whose lock (``path``, open as ``fd``) another run holds:
    another process, or this one (a Trainer not closed yet: its pid is in the file)."""
    if _lock_info(fd).get("pid") == os.getpid():
        return RunDirLocked(
            f"run_dir {run_dir} is in use by another run of this process (pid {os.getpid()}, holding {path}: a "
            "Trainer on it that is not closed yet); two runs never write one directory. Close that Trainer first "
            "(trainer.close(), or leave its with-block), or give another run_dir"
        )
    return RunDirLocked(
        f"--run-dir {run_dir} is in use by another run ({_holder(fd)}, holding {path}); two runs never write "
        "one directory. Wait for it to finish or stop it, or give another --run-dir"
    )


def _lock_info(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _holder(fd: int) -> str:
    info = _lock_info(fd)
    if not info.get("pid"):
        return "a process that has not written its name yet"
    return (
        f"pid {info['pid']} on {info.get('host', '?')}, started {info.get('started', '?')}: {info.get('command', '?')}"
    )


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


def resolve_resume(
    resume: str | Path | None,
    run_dir: Path,
    flag: str = "--resume",
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
) -> Path | None:
    """``resume`` -> a complete checkpoint directory, or None (nothing to resume from).

    Args:
        resume: None; ``"auto"``: the newest complete checkpoint in ``run_dir`` whose files
            are intact (None when there is none yet, so one job script serves the first
            submission and every requeue; a damaged newer one is skipped, saying so through
            ``warn``); ``"latest"`` or ``"best"`` (``checkpoint.keep_best``) of ``run_dir``,
            which must exist; a checkpoint directory (``step_N``); or a run directory, meaning its
            newest complete checkpoint.
        run_dir: the run's directory (for ``"auto"``).
        flag: how messages name the option (``--resume`` on the command line).
        verify: check the checkpoint's files against their checksums
            (``recsys_dist.checkpoint.integrity.verify_checkpoint``): ``auto`` falls back to an older
            intact checkpoint, every other form refuses a damaged one.
        warn: where ``auto``'s fallback is reported (default: stderr).

    Raises:
        CheckpointError: the path is a file, does not exist, is an incomplete checkpoint,
            or is a run directory without a complete checkpoint.
        CheckpointDamaged: the checkpoint named (``latest``, ``best``, a path) is damaged,
            or, for ``auto``, every checkpoint is: naming the damaged file (and an intact
            checkpoint to use instead, if any).
    """
    if not resume:
        return None
    if resume == "auto":
        return newest_intact_checkpoint(Path(run_dir), warn) if verify else latest_checkpoint(Path(run_dir))
    if resume in ("best", "latest"):
        path = named_checkpoint(resume, run_dir)
        return intact_checkpoint(path) if verify else path
    path = Path(resume)
    if path.is_file():
        raise CheckpointError(f"{flag} {path} is a file; give a checkpoint directory (step_N) or a run directory")
    if (path / "checkpoints").is_dir():  # a run directory: its newest complete checkpoint
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{flag} {path}: this run directory has no complete checkpoint")
        path = found
    read_meta(path)  # raises CheckpointError naming what is wrong
    return intact_checkpoint(path) if verify else path


def check_stream_resume(checkpoint: Path, meta: dict, stream: bool, global_batch: int) -> None:
    """Refuse a resume that would lose or repeat rows of a stream (``data.stream``): a stream
    checkpoint continued by a run over ``data.raw_path`` or the reverse (``stream``: whether the
    resuming run streams), or another ``global_batch`` inside a partition, whose row order is
    that of its global batches (it may change between partitions).

    Raises:
        CheckpointError: the kind of run differs. ConfigError: the global batch differs.
    """
    saved = meta.get("stream")
    if (saved is not None) != stream:
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by a run over data.stream, not data.raw_path; a run over "
            "data.raw_path cannot continue it (its stream position would be lost): give the data.stream it was "
            "trained with, or another --run-dir"
            if not stream
            else f"checkpoint {checkpoint} was written by a run over data.raw_path, not data.stream; a stream run "
            "starts from scratch or from a stream run's checkpoint"
        )
    if saved and saved.get("current") and saved.get("batches") and saved.get("global_batch") != global_batch:
        raise ConfigError(
            f"checkpoint {checkpoint} stopped inside partition {saved['current']} after {saved['batches']} "
            f"global batches of {saved.get('global_batch')} rows; this run's global batch (train.batch_size x ranks) "
            f"is {global_batch}: resume with a global batch of {saved.get('global_batch')}; it may change between "
            "partitions"
        )


def data_identity(prepared_dir: Path, raw_path) -> dict | None:
    """The training data's identity a checkpoint records (``meta.json`` ``data``): the
    conversion's training split (``recsys_dist.data.convert.manifest.train_identity``) and the raw
    file(s) it came from (for messages); None when the entry records no checksums."""
    found = train_identity(Path(prepared_dir))
    return {**found, "raw": describe_raw_path(raw_path)} if found is not None else None


def check_same_data(checkpoint: Path, meta: dict, identity: dict | None, allow: bool, flag: str) -> bool:
    """Whether a resume continues on other training data than ``checkpoint`` was trained on.

    Checkpoints from before data identities were recorded, and identities made with another
    checksum algorithm, cannot be compared: False.

    Args:
        identity: :func:`data_identity` of the data the resumed run would train on.
        allow: resume on other data (``--resume-on-new-data``): then True is returned.
        flag: how the message names that option.

    Raises:
        DataChanged: the training split differs and ``allow`` is False: naming both splits
            (raw file, rows, fingerprint, cache entry) and ``flag``.
    """
    saved = meta.get("data")
    if not saved or not identity or saved.get("algorithm") != identity.get("algorithm"):
        return False
    if saved["fingerprint"] == identity["fingerprint"]:
        return False
    if allow:
        return True

    def show(d: dict) -> str:
        return f"{d['rows']:,} training rows of {d['raw']} (fingerprint {d['fingerprint']}, cache entry {d['entry']})"

    raise DataChanged(
        f"checkpoint {checkpoint} was trained on other data: it was trained on {show(saved)}; the data now gives "
        f"{show(identity)}. Resuming would continue its epoch on other rows and mix two datasets in one run. "
        f"Restore the data it was trained on, train into a new --run-dir, or resume on the new data with {flag}; "
        "the interrupted epoch then starts again from its first batch, over the new data"
    )


def _saved_global_batch(meta: dict) -> int | None:
    try:
        return int(meta["config"]["train"]["batch_size"]) * int(meta["world_size"])
    except (KeyError, TypeError, ValueError):
        return None


def resume_batch(meta: dict, global_batch: int | None) -> tuple[int, int]:
    """``(epoch, batch)`` a resumed run (on the same data) continues at: the checkpoint's, or,
    when the global batch (``train.batch_size`` x ranks) differs from the checkpoint's, the
    batch that holds its position in rows, rounded down (a part of one batch is trained
    again, no row is skipped), and the next epoch when the checkpoint's had ended.

    Its ``batches_in_epoch`` counts batches of its own global batch: read as batches of
    another size, a resume on twice the ranks skipped the rest of the epoch (or, as the
    run's last epoch, trained nothing more, exit 0), on half the ranks trained half of it twice.
    """
    epoch, done = int(meta.get("epoch", 0)), int(meta.get("batches_in_epoch", 0))
    old = _saved_global_batch(meta)
    if global_batch is None or old is None or old == global_batch:
        return epoch, done
    if done >= meta.get("steps_per_epoch", float("inf")):
        return epoch + 1, 0
    return epoch, done * old // global_batch


def resume_position(
    meta: dict, steps_per_epoch: int, new_data: bool, global_batch: int | None = None
) -> tuple[int, int]:
    """``(epoch, offset)`` a resumed run continues with: the epoch it starts in, and the
    global step at which epoch 0 would have started had every epoch been ``steps_per_epoch``
    steps (0 for a run on one dataset), so that the run ends after ``train.epochs`` epochs at
    step ``offset + epochs * steps_per_epoch``.

    On new data the checkpoint's position within its epoch means nothing (another row set,
    another order): that epoch starts again from its first batch (the next one when the
    checkpoint was at an epoch's end), at the checkpoint's step.
    """
    if not new_data:
        old = _saved_global_batch(meta)
        if global_batch is None or old is None or old == global_batch:
            return int(meta.get("epoch", 0)), int(meta.get("step_offset", 0))
        epoch, batch = resume_batch(meta, global_batch)  # counted in batches of another size
        return epoch, int(meta["step"]) - epoch * steps_per_epoch - batch
    finished = meta["batches_in_epoch"] >= meta.get("steps_per_epoch", float("inf"))
    epoch = int(meta["epoch"]) + int(finished)
    return epoch, int(meta["step"]) - epoch * steps_per_epoch


def checkpoint_step(checkpoint: Path) -> int:
    """The step a complete checkpoint was written at (from its ``meta.json``)."""
    return int(read_meta(checkpoint)["step"])


def nothing_to_train(run_dir: Path, checkpoint: Path, step: int, total: int | None = None) -> str:
    """What a resume that has nothing left to train says, in the user's terms: the ``--run-dir``
    given (not the directory the checkpoint's run was first trained in, which ``summary.json``
    records and which differs once a run directory is copied or moved), and the checkpoint
    only when it lies outside that directory. ``total``: the steps the config trains (None:
    ``step`` is the last)."""
    run_dir, checkpoint = Path(run_dir), Path(checkpoint)
    limit = f"this config trains {total} steps in all" if total is not None else "that is this config's last step"
    inside = run_dir.resolve() in checkpoint.resolve().parents
    where = (
        f"the run in {run_dir} is already at step {step} (checkpoint {checkpoint.name})"
        if inside
        else f"checkpoint {checkpoint} (--resume) is already at step {step}"
    )
    return (
        f"recsys-dist: nothing to train: {where}, and {limit}; nothing in {run_dir} was trained or changed "
        "(raise train.epochs or train.max_steps to continue)"
    )


def noop_summary(run_dir: Path, checkpoint: Path, step: int) -> dict:
    """The summary of a resume with nothing left to train: ``summary.json`` of ``run_dir`` (if
    any) with ``run_dir`` the directory given (``summary.json`` names the one the run was first
    trained in), ``steps`` the checkpoint's step, ``resumed_from`` its path and
    ``already_complete: True``."""
    return {
        **read_summary(run_dir),
        "run_dir": str(run_dir),
        "steps": step,
        "resumed_from": str(checkpoint),
        "already_complete": True,
    }


def write_config(tree: dict, run_dir: Path, write: bool = True) -> None:
    """Create ``run_dir`` and, if ``write``, its ``config.yaml``: the resolved config ``tree``
    (``Job.to_dict()``: absolute paths, every default filled in), written atomically (a symbolic
    link there is replaced, never written through: ``recsys_dist.files``).

    Raises:
        ConfigError: the directory cannot be created or written.
    """
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if write:
            write_atomic(run_dir / "config.yaml", yaml.safe_dump(tree, sort_keys=False))
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
