"""Checkpoint integrity: the size and CRC-32 of every file, written at save and compared
before anything is loaded, so that a damaged checkpoint is named and never loaded.

``checksums.json`` (``{"algorithm": "crc32", "files": {name: {"size", "crc32"}}}``) lists
every rank's shards, DCP's ``.metadata`` and ``meta.json``. :func:`verify_checkpoint` checks
one checkpoint; :func:`newest_intact_checkpoint` finds the newest one that passes (``--resume auto``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

from recsys_dist.checkpoint.meta import is_complete, marked_name, read_meta
from recsys_dist.errors import CheckpointDamaged, CheckpointError

CHECKSUMS_FILE = "checksums.json"
# Set (and inherited by the ranks a launcher starts) once a checkpoint has been verified: the
# stat signature of its files, so the ranks do not read every shard again (see verify_checkpoint).
VERIFIED_ENV = "RECSYS_DIST_VERIFIED_CHECKPOINT"


def file_sum(path: Path) -> dict:
    """``{"size", "crc32"}`` of a file, read in 8 MiB pieces (CRC-32: ~2 GB/s, for damage, not tampering)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def own_sums(directory: Path, rank: int) -> dict:
    """Sizes and checksums of the files rank ``rank`` wrote into a DCP checkpoint directory:
    its shards ``__<rank>_<n>.distcp`` and, rank 0, the ``.metadata`` index."""
    names = sorted(p.name for p in directory.iterdir() if p.name.startswith(f"__{rank}_") and p.suffix == ".distcp")
    if rank == 0:
        names.append(".metadata")
    return {n: file_sum(directory / n) for n in names}


def _signature(path: Path) -> str:
    """The checkpoint's path and the stat (size, mtime, ctime, inode) of its files: a file
    written or replaced since changes it."""
    parts = [str(Path(path).resolve())]
    for f in sorted(Path(path).iterdir()):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}")
    return hashlib.blake2b(";".join(parts).encode(), digest_size=12).hexdigest()


def verify_checkpoint(path: Path) -> None:
    """Check a complete checkpoint's files against ``checksums.json`` (sizes, then CRC-32s)
    and that its ``meta.json`` parses and records this checkpoint format. Reads every file
    once: about 0.5 s per GB.

    Once a checkpoint passed, the stat signature of its files is kept in ``$RECSYS_DIST_VERIFIED_CHECKPOINT``
    (inherited by the ranks a launcher starts), and an unchanged checkpoint is not read again.

    Raises:
        CheckpointDamaged: naming the checkpoint, the first damaged file and what is wrong.
        CheckpointError: the checkpoint does not exist, is incomplete, or is of another
            checkpoint format (``recsys_dist.checkpoint.meta.check_format``).
    """
    path = Path(path)

    def damaged(name: str, what: str) -> CheckpointDamaged:
        err = CheckpointDamaged(f"checkpoint {path} is damaged: {path / name}: {what}")
        err.path, err.file = path, path / name
        return err

    if not path.is_dir() or not is_complete(path):
        read_meta(path)  # raises CheckpointError: missing or incomplete
    signature = _signature(path)
    if os.environ.get(VERIFIED_ENV) == signature:
        return
    read_meta(path)  # a meta.json that is not JSON is damage; another format is refused
    listed = path / CHECKSUMS_FILE
    if not listed.exists():  # every checkpoint of this format is written with it
        raise damaged(CHECKSUMS_FILE, "the file is missing (every checkpoint of this format is written with it)")
    try:
        files = json.loads(listed.read_text())["files"]
        assert isinstance(files, dict)
    except (ValueError, OSError, KeyError, TypeError, AssertionError) as err:
        raise damaged(CHECKSUMS_FILE, f"unreadable ({type(err).__name__}: {err})") from None
    for name, want in files.items():
        if not (path / name).is_file():
            raise damaged(name, "the file is missing")
        size = (path / name).stat().st_size
        if size != want.get("size"):
            raise damaged(name, f"{size:,} bytes where {want.get('size'):,} were written")
    for name, want in files.items():
        try:
            got = file_sum(path / name)
        except OSError as err:
            raise damaged(name, describe_error(err)) from None
        if got["crc32"] != want.get("crc32"):
            raise damaged(name, "its CRC-32 differs from the one recorded when it was written (overwritten)")
    os.environ[VERIFIED_ENV] = signature


def intact_checkpoint(path: Path) -> Path:
    """``path`` itself after :func:`verify_checkpoint`; a damaged one is refused naming the
    file and the newest intact checkpoint beside it to use instead.

    Raises:
        CheckpointDamaged: ``path`` is damaged.
    """
    try:
        verify_checkpoint(path)
    except CheckpointDamaged as err:
        older = _newest_intact(Path(path).parent.parent, skip=Path(path).name)
        err.args = (
            f"{err}. "
            + (
                f"The newest intact checkpoint is {older}: use that one (train --resume auto falls back to it)"
                if older
                else "No other intact checkpoint is left; start again"
            ),
        )
        raise
    return path


def _candidates(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run directory, newest first: the one ``latest`` names, then the others."""
    root = Path(run_dir) / "checkpoints"
    done = sorted((p for p in root.glob("step_*") if is_complete(p)), reverse=True)
    newest = marked_name(root, "latest")
    first = [p for p in done if p.name == newest]
    return first + [p for p in done if p.name != newest]


def _newest_intact(run_dir: Path, skip: str | None = None) -> Path | None:
    for p in _candidates(run_dir):
        if p.name == skip:
            continue
        try:
            verify_checkpoint(p)
            return p
        except CheckpointError:
            continue
    return None


def newest_intact_checkpoint(run_dir: Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete checkpoint of a run directory whose files verify
    (:func:`verify_checkpoint`), or None when there is no complete checkpoint. Each damaged
    newer one is reported through ``warn`` (default: stderr), naming its damaged file and the
    checkpoint used instead.

    Raises:
        CheckpointDamaged: every complete checkpoint is damaged (the newest one's file named).
    """
    warn = warn or (lambda text: print(f"recsys-dist: warning: {text}", file=sys.stderr))
    problems = []
    for p in _candidates(run_dir):
        try:
            verify_checkpoint(p)
        except CheckpointDamaged as err:
            problems.append(err)
            continue
        for err in problems:
            warn(f"{err}; falling back to the newest intact checkpoint, {p}")
        return p
    if problems:
        err = problems[0]
        err.args = (
            f"{err}; no intact checkpoint is left in {Path(run_dir) / 'checkpoints'} "
            f"({len(problems)} damaged). Move checkpoints/ away to start again",
        )
        raise err
    return None


def describe_error(err: BaseException) -> str:
    """One line for a failed read or write: ``[Errno N] text: file`` for an OSError, else ``Type: text``."""
    if isinstance(err, OSError) and err.errno is not None:
        where = f": {err.filename}" if err.filename else ""
        text = f"[Errno {err.errno}] {err.strerror or os.strerror(err.errno)}{where}"
    else:
        text = f"{type(err).__name__}: {str(err)[:500]}"
    # torch's writer reports a write cut short (EFBIG under `ulimit -f`, as Python ignores
    # SIGXFSZ) only as "unexpected pos A vs B"; say what it means.
    if (isinstance(err, OSError) and err.errno == errno.EFBIG) or "unexpected pos" in str(err):
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        text += (
            f" -- a write was cut short: the process may write files of at most {limit:,} bytes (ulimit -f); "
            "raise that limit"
            if limit != resource.RLIM_INFINITY
            else " -- a write was cut short (disk full?)"
        )
    return text
