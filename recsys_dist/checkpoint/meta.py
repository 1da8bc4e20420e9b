"""Where a run's checkpoints are and what ``meta.json`` says: the ``latest`` / ``best``
markers, completeness, and the checkpoint format this recsys_dist reads.

A checkpoint directory is complete when it holds DCP's ``.metadata`` and ``meta.json``;
``meta.json`` records ``checkpoint_format``. Format 2 (this recsys_dist) always has
``checksums.json`` and the first-order tables of DeepFM / Wide & Deep / xDeepFM in
``sparse_arch``; a checkpoint of any other format is refused by :func:`read_meta`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from recsys_dist.errors import CheckpointDamaged, CheckpointError

# The layout of a checkpoint directory and its meta.json. 1: recsys_dist 0.1.0 (no version
# recorded; checksums.json and the one-collection first-order tables optional); 2: both always.
CHECKPOINT_FORMAT = 2
# The release that wrote (and still reads) format 1, named in the refusal.
FORMAT_1_RELEASE = "0.1.0"


def check_format(path: Path, meta: dict) -> None:
    """Refuse a checkpoint whose ``meta.json`` records another format than :data:`CHECKPOINT_FORMAT`.

    Raises:
        CheckpointError: naming the checkpoint, the format found, the one expected and what to do.
    """
    found = meta.get("checkpoint_format", 1)
    if found == CHECKPOINT_FORMAT:
        return
    if isinstance(found, int) and found > CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} was written by a newer recsys_dist (checkpoint format {found}; this one reads "
            f"format {CHECKPOINT_FORMAT}): upgrade recsys_dist to load it"
        )
    raise CheckpointError(
        f"checkpoint {path} was written by an older recsys_dist (checkpoint format {found!r}; this one reads "
        f"format {CHECKPOINT_FORMAT} only): retrain, or use recsys_dist {FORMAT_1_RELEASE} to evaluate or export it"
    )


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run directory, or None.

    Uses ``checkpoints/latest``; if that names a missing directory (deleted by hand), falls
    back to the newest ``step_*`` directory holding both ``.metadata`` and ``meta.json``.
    """
    root = Path(run_dir) / "checkpoints"
    name = marked_name(root, "latest")
    if name and is_complete(root / name):
        return root / name
    done = sorted(p for p in root.glob("step_*") if is_complete(p))
    return done[-1] if done else None


def marked_name(root: Path, name: str) -> str | None:
    """The checkpoint name the marker ``root/name`` holds; None when it is absent or damaged
    (not UTF-8, not one plain ``step_N`` name), so that callers fall back to the newest
    complete ``step_*`` directory instead of raising."""
    marker = root / name
    try:
        text = marker.read_bytes().decode().strip() if marker.is_file() else ""
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.startswith("step_") and Path(text).name == text else None


def best_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/best`` names (``checkpoint.keep_best``), if complete; else None."""
    root = Path(run_dir) / "checkpoints"
    name = marked_name(root, "best")
    return root / name if name and is_complete(root / name) else None


def named_checkpoint(ref: str | Path, run_dir: Path | None = None) -> Path:
    """``best`` or ``latest`` of ``run_dir``, a marker file ``RUN/checkpoints/best|latest``, a
    run directory (its newest complete checkpoint) or a checkpoint directory -> the checkpoint.

    Raises:
        CheckpointError: no such checkpoint (naming what is missing and how to get it).
    """
    if str(ref) in ("best", "latest"):
        if run_dir is None:
            raise CheckpointError(f"{ref!s}: give the run directory it belongs to (--run-dir)")
        ref, run_dir = str(ref), Path(run_dir)
        found = best_checkpoint(run_dir) if ref == "best" else latest_checkpoint(run_dir)
        if found is None:
            hint = " (it is kept with checkpoint.keep_best: true)" if ref == "best" else ""
            raise CheckpointError(f"{run_dir}: no complete {ref} checkpoint{hint}")
        return found
    path = Path(ref)
    if path.is_file() and path.name in ("best", "latest") and path.parent.name == "checkpoints":
        return named_checkpoint(path.name, path.parent.parent)
    if (path / "checkpoints").is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{path}: this run directory has no complete checkpoint")
        return found
    read_meta(path)  # raises CheckpointError naming what is wrong
    return path


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a finished checkpoint directory (``.metadata`` and ``meta.json``, not ``*.tmp``)."""
    return (
        path.is_dir()
        and not path.name.endswith(".tmp")
        and (path / ".metadata").is_file()
        and (path / "meta.json").is_file()
    )


def read_meta(path: Path) -> dict:
    """``meta.json`` of a checkpoint (a JSON object).

    Raises:
        CheckpointError: the checkpoint is absent or incomplete, or of another format
            (:func:`check_format`); ``CheckpointDamaged`` when ``meta.json`` is not JSON.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        missing = [f for f in (".metadata", "meta.json") if not (path / f).is_file()]
        raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing")
    try:
        meta = json.loads((path / "meta.json").read_text())
        problem = None if isinstance(meta, dict) else f"a JSON {type(meta).__name__}, not an object"
    except ValueError as err:
        problem = f"not valid JSON ({err})"
    if problem is not None:
        damaged = CheckpointDamaged(f"checkpoint {path} is damaged: {path / 'meta.json'}: {problem}")
        damaged.path, damaged.file = path, path / "meta.json"
        raise damaged from None
    check_format(path, meta)
    return meta
