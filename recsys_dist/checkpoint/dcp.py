"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic saves, resume, reshard.

Layout of a run directory's ``checkpoints/``::

    step_00000120/      one DCP checkpoint: every rank's shards, .metadata, meta.json,
                        checksums.json (size and CRC-32 of each of those files)
    latest              text file naming the newest complete checkpoint; written last
    best                (checkpoint.keep_best) text file naming the best-validation checkpoint,
                        which ``checkpoint.keep`` never deletes

A checkpoint is written into ``step_N.tmp`` and renamed by rank 0 once every rank has
finished, and ``latest`` is replaced (write + rename) only after that, so a crash mid-save
never leaves a half-written checkpoint as the newest one. Each rank checksums the shard
files it wrote; rank 0 writes every file's size and CRC-32 into ``checksums.json`` before
the rename, and :func:`verify_checkpoint` compares them before anything is loaded (a shard
overwritten in place, same size, is found; a damaged checkpoint is named, never loaded).

What is saved: the model's sharded state dict (embedding shards, dense weights), the
optimizers' state (the fused embedding optimizer's per-row state as sharded tensors, the
dense optimizer's), the torch RNG state, and in ``meta.json`` the step, epoch, batches
consumed in the epoch, world size, sharding plan and resolved config. DCP stores tensors
with their global offsets, so a checkpoint loads onto any world size or sharding plan
(resharding); an entry the new model has but the checkpoint lacks is an error naming it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import resource
import shutil
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from recsys_dist.distributed.env import DistContext
from recsys_dist.errors import CheckpointDamaged, CheckpointError  # noqa: F401 (raised here; defined in errors)
from recsys_dist.faults import maybe_fault

CHECKSUMS_FILE = "checksums.json"
# Set (and inherited by the ranks a launcher starts) once a checkpoint has been verified: the
# stat signature of its files, so the ranks do not read every shard again (see verify_checkpoint).
VERIFIED_ENV = "RECSYS_DIST_VERIFIED_CHECKPOINT"


def save_checkpoint(
    ctx: DistContext, run_dir: Path, step: int, state: dict, meta: dict, keep: int = 2, best: bool = False
) -> Path:
    """Save ``state`` (nested dict of tensors / ShardedTensors) as checkpoint ``step``.

    Every rank must call this (it is collective). Keeps the newest ``keep`` checkpoints and
    the one ``checkpoints/best`` names; ``best``: this one becomes ``checkpoints/best``.
    Returns the final checkpoint directory.

    Raises:
        CheckpointError: on every rank at once, when any rank cannot write (disk full,
            read-only or vanished directory, too little free space for the estimated size).
            The partial ``step_N.tmp`` is removed and the previous ``latest`` is left as it was.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    need = _global_bytes(ctx, state)

    def prepare() -> None:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            free = shutil.disk_usage(tmp).free
            if free < need * 1.05:
                raise OSError(
                    errno.ENOSPC, f"about {need / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB free", str(root)
                )

    sums: dict = {}

    def finish() -> None:
        if ctx.is_main:
            # meta.json says a checksums.json belongs to it, so that losing that file is damage
            # too (not taken for a checkpoint from before checksums, which is loaded unchecked).
            (tmp / "meta.json").write_text(json.dumps({**meta, "checksums": CHECKSUMS_FILE}, indent=2))
            files = {n: v for part in gathered for n, v in part.items()}
            files["meta.json"] = _file_sum(tmp / "meta.json")
            (tmp / CHECKSUMS_FILE).write_text(json.dumps({"algorithm": "crc32", "files": files}, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for name in ("latest", "best") if best else ("latest",):
                marker = root / f"{name}.tmp"
                marker.write_text(final.name + "\n")
                marker.rename(root / name)
            kept = _marked(root, "best")
            # The newest `keep` up to this step. A resume from an older checkpoint leaves later
            # steps of the run it abandoned: counted as newer, they had this checkpoint, just
            # named by `latest`, deleted at once (and auto then took the abandoned run's).
            done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
            for old in [p for p in done if p.name <= final.name][:-keep]:
                if old.name != kept:
                    shutil.rmtree(old, ignore_errors=True)

    def write() -> None:
        try:
            dcp.save(state, storage_writer=_Writer(tmp, step, ctx.rank))
        except CheckpointException as err:
            # DCP has gathered every rank's failure and raised on all ranks; report the first.
            rank, (exc, _) = next(iter(err.failures.items()))
            raise _RankFailure(rank, _describe(exc)) from None
        sums.update(_own_sums(tmp, ctx.rank))  # the files this rank wrote, while they are in its page cache
        maybe_fault("save", step, ctx.rank)

    gathered: list = [sums]
    for stage in (prepare, write, finish):
        if stage is finish and ctx.world_size > 1:
            gathered = [None] * ctx.world_size
            dist.all_gather_object(gathered, sums)
        _on_all_ranks(ctx, stage, step, root, tmp)
    return final


def _file_sum(path: Path) -> dict:
    """``{"size", "crc32"}`` of a file, read in 8 MiB pieces (CRC-32: ~2 GB/s, for damage, not tampering)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def _own_sums(directory: Path, rank: int) -> dict:
    """Sizes and checksums of the files rank ``rank`` wrote into a DCP checkpoint directory:
    its shards ``__<rank>_<n>.distcp`` and, rank 0, the ``.metadata`` index."""
    names = sorted(p.name for p in directory.iterdir() if p.name.startswith(f"__{rank}_") and p.suffix == ".distcp")
    if rank == 0:
        names.append(".metadata")
    return {n: _file_sum(directory / n) for n in names}


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
    and that its ``meta.json`` parses. Reads every file once: about 0.5 s per GB.

    A checkpoint from before checksums were recorded has only ``meta.json`` checked. Once a
    checkpoint passed, the stat signature of its files is kept in ``$RECSYS_DIST_VERIFIED_CHECKPOINT``
    (inherited by the ranks a launcher starts), and an unchanged checkpoint is not read again.

    Raises:
        CheckpointDamaged: naming the checkpoint, the first damaged file and what is wrong.
        CheckpointError: the checkpoint does not exist or is incomplete.
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
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (ValueError, OSError) as err:
        raise damaged("meta.json", f"not valid JSON ({err})") from None
    listed = path / CHECKSUMS_FILE
    if not listed.exists() and isinstance(meta, dict) and meta.get("checksums") == CHECKSUMS_FILE:
        raise damaged(CHECKSUMS_FILE, "the file is missing (meta.json says the checkpoint was written with it)")
    if listed.exists():
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
                got = _file_sum(path / name)
            except OSError as err:
                raise damaged(name, _describe(err)) from None
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
    marked = _marked(root, "latest")
    first = [p for p in done if p.name == marked]
    return first + [p for p in done if p.name != marked]


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


class _Writer(FileSystemWriter):
    """DCP's file writer, with the ``disk_full`` fault point of the robustness tests."""

    def __init__(self, path: Path, step: int, rank: int) -> None:
        super().__init__(str(path))
        self._step, self._rank = step, rank

    def write_data(self, plan, planner):
        maybe_fault("disk_full", self._step, self._rank)
        return super().write_data(plan, planner)


class _RankFailure(Exception):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(text)
        self.rank, self.text = rank, text


def _on_all_ranks(ctx: DistContext, stage, step: int, root: Path, tmp: Path) -> None:
    """Run one stage of a save on every rank; if it failed anywhere, every rank raises.

    Replaces a plain barrier: a rank that failed alone would otherwise leave the others
    waiting in the next collective until the launcher's timeout.
    """
    try:
        stage()
        problem = None
    except _RankFailure as err:
        problem = (err.rank, err.text)
    except Exception as err:  # noqa: BLE001 - any failure of the stage is reported the same way
        problem = (ctx.rank, _describe(err))
    problems = [problem]
    if ctx.world_size > 1:
        problems = [None] * ctx.world_size
        dist.all_gather_object(problems, problem)
    failed = [p for p in problems if p is not None]
    if not failed:
        return
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # give the space of the partial save back
    latest = latest_checkpoint(root.parent)
    rank, what = failed[0]
    err = CheckpointError(
        f"checkpoint at step {step} could not be written under {root} (rank {rank}: {what}). "
        f"The previous checkpoint is intact: {latest or 'none was written yet'}. Free disk space or make "
        f"the run directory writable, then continue with --resume auto --run-dir {root.parent}."
    )
    err.every_rank = True  # the same error on every rank: reported once (recsys_dist.cli.main)
    raise err


def _describe(err: BaseException) -> str:
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


def _global_bytes(ctx: DistContext, state: dict) -> int:
    """Bytes this checkpoint will hold, summed over ranks (each rank counts its own shards)."""
    total = 0
    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, ShardedTensor):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in v.local_shards())
        elif isinstance(v, torch.Tensor):
            t = v.to_local() if hasattr(v, "to_local") else v
            # A replicated tensor is written once, by rank 0, so only rank 0 counts it.
            total += t.numel() * t.element_size() if ctx.is_main or hasattr(v, "to_local") else 0
    if ctx.world_size > 1:
        n = torch.tensor([total], dtype=torch.int64)
        dist.all_reduce(n)
        total = int(n)
    return total


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run directory, or None.

    Uses ``checkpoints/latest``; if that names a missing directory (deleted by hand), falls
    back to the newest ``step_*`` directory holding both ``.metadata`` and ``meta.json``.
    """
    root = Path(run_dir) / "checkpoints"
    name = _marked(root, "latest")
    if name and is_complete(root / name):
        return root / name
    done = sorted(p for p in root.glob("step_*") if is_complete(p))
    return done[-1] if done else None


def _marked(root: Path, name: str) -> str | None:
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
    name = _marked(root, "best")
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
    return (
        path.is_dir()
        and not path.name.endswith(".tmp")
        and (path / ".metadata").is_file()
        and (path / "meta.json").is_file()
    )


def read_meta(path: Path) -> dict:
    """``meta.json`` of a checkpoint. Raises CheckpointError when absent or unreadable."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        missing = [f for f in (".metadata", "meta.json") if not (path / f).is_file()]
        raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing")
    try:
        return json.loads((path / "meta.json").read_text())
    except ValueError as err:
        damaged = CheckpointDamaged(f"checkpoint {path} is damaged: {path / 'meta.json'}: not valid JSON ({err})")
        damaged.path, damaged.file = path, path / "meta.json"
        raise damaged from None


def check_compatible(
    path: Path,
    meta: dict,
    config: dict,
    tables: bool = True,
    sizes: list[int] | None = None,
    world_size: int | None = None,
    user_model: bool = False,
) -> None:
    """Refuse a checkpoint written by a model config other than ``config`` (a resolved
    config dict): the model section, the table sizes (unless ``tables`` is False: sizes
    that come from a vocabulary are only known once the data is converted; ``sizes``, the
    sizes the data preparation decided, are compared with the checkpoint's when both are
    known), the pooling of each feature, ``data.categorical_mapping``, ``data.managed``,
    the sequence features (``data.schema.sequence`` / ``history``), the optimizers and the
    tasks (names, order, kinds of ``data.schema.labels``) must match; sharding, world size,
    batch size and schedule may differ, except that under managed tables the global batch
    (``train.batch_size`` x ``world_size``, the ranks of the resumed run, when given) must
    not: the replicated managed-collision history is sized by it.

    ``user_model``: the resuming Trainer was given its model (``Trainer(model=...)``); a
    checkpoint of such a model resumes only into one, and one of ``model.name`` only into that.

    Raises:
        CheckpointError: naming each differing key, old -> new.
    """
    saved = meta.get("config", {})
    diffs = []
    if bool(meta.get("user_model")) != user_model:
        where = ("given to Trainer(model=...)", "named by the config's model.name")
        old, new = where if meta.get("user_model") else where[::-1]
        diffs.append(f"model {old} -> {new} (a model given in Python resumes only into a Trainer given it)")
    for section, keys in (
        ("model", None),
        ("data", (("num_embeddings",) if tables else ()) + ("pooling", "feature_pooling", "categorical_mapping")),
        ("train", ("embedding_optimizer", "dense_optimizer")),
    ):
        old, new = saved.get(section, {}), config.get(section, {})
        names = list(new) if keys is None else keys
        # A key the checkpoint's config lacks was added since it was written: nothing to compare.
        names = [k for k in names if k in old or section == "model"]
        diffs += [f"{section}.{k} {old.get(k)!r} -> {new.get(k)!r}" for k in names if old.get(k) != new.get(k)]
    if _tasks(saved) != _tasks(config):  # the output columns' meaning: names, order and kinds
        diffs.append(f"tasks (data.schema.labels) {_tasks(saved)} -> {_tasks(config)}")
    old_data, new_data = saved.get("data", {}), config.get("data", {})
    old_m, new_m = old_data.get("managed"), new_data.get("managed")
    if isinstance(old_m, dict) and isinstance(new_m, dict):
        diffs += [
            f"data.managed.{k} {old_m.get(k)!r} -> {new_m.get(k)!r}"
            for k in sorted(set(old_m) | set(new_m))
            if old_m.get(k) != new_m.get(k)
        ]
    elif old_m != new_m and "categorical_mapping" in old_data:
        diffs.append(f"data.managed {old_m!r} -> {new_m!r}")
    old_s, new_s = old_data.get("schema") or {}, new_data.get("schema") or {}
    for k in ("sequence", "history"):
        o, n = old_s.get(k) or None, new_s.get(k) or None  # {} and None both: no such features
        if o != n:
            diffs.append(f"data.schema.{k} {o!r} -> {n!r}")
    if sizes is not None and meta.get("num_embeddings") not in (None, list(sizes)):
        diffs.append(f"table sizes {meta['num_embeddings']} -> {list(sizes)}")
    managed_now = new_data.get("categorical_mapping") == "managed" or (new_data.get("managed") or {}).get("features")
    if managed_now and world_size is not None and "world_size" in meta:
        old_b, new_b = saved.get("train", {}).get("batch_size"), config.get("train", {}).get("batch_size")
        if old_b is not None and new_b is not None and old_b * meta["world_size"] != new_b * world_size:
            diffs.append(
                f"global batch (train.batch_size x ranks) {old_b} x {meta['world_size']} = "
                f"{old_b * meta['world_size']} -> {new_b} x {world_size} = {new_b * world_size} "
                "(managed tables' replicated history is sized by it; keep it equal"
                + (
                    f", train.batch_size={old_b * meta['world_size'] // world_size})"
                    if not old_b * meta["world_size"] % world_size
                    else ")"
                )
            )
    if diffs:
        raise CheckpointError(f"checkpoint {path} was written by a different config: {', '.join(diffs)}")


def _tasks(config: dict) -> list[str]:
    """``name:kind`` per task of a resolved config dict (``label:binary`` for the one-task form)."""
    schema = (config.get("data") or {}).get("schema") or {}
    labels = schema.get("labels") or {}
    return [f"{n}:{(t or {}).get('kind', 'binary')}" for n, t in labels.items()] or ["label:binary"]


# Checkpoints written before docs/design/0001-first-order-tables-in-one-collection.md hold the
# first-order tables of DeepFM, Wide & Deep and xDeepFM in a collection of their own,
# ``first_order``; they now share ``sparse_arch``.
_FIRST_ORDER_NOW, _FIRST_ORDER_BEFORE = ".sparse_arch.embedding_bags.w_", ".first_order.embedding_bags.w_"


def checkpoint_keys(path: Path) -> set[str]:
    """The flattened names of every entry saved in the checkpoint at ``path``
    (``"model.<fqn>"``, ``"optimizer.<...>"``, ``"rng.rank_<r>"``)."""
    return set(SafeReader(path).read_metadata().state_dict_metadata)


def in_saved_layout(state: dict, path: Path) -> dict:
    """``state`` (``{"model": ..., "optimizer": ..., ...}``) re-keyed to the layout of the
    checkpoint at ``path`` when that is the older one; the values are the same objects, so
    loading into the result in place loads into ``state``."""
    saved = SafeReader(path).read_metadata().state_dict_metadata
    if not any(_FIRST_ORDER_BEFORE in k for k in saved):
        return state
    return {
        top: {k.replace(_FIRST_ORDER_NOW, _FIRST_ORDER_BEFORE): v for k, v in sub.items()}
        if top in ("model", "optimizer")
        else sub
        for top, sub in state.items()
    }


def load_checkpoint(path: Path, state: dict, verify: bool = True) -> None:
    """Load a checkpoint in place into ``state`` (the live model / optimizer state dicts).

    The target's sharding may differ from the one saved (resharding); so may the layout, from
    the older one of :func:`in_saved_layout`. Collective when a process group exists: with
    ``verify`` (default) rank 0 checks the files' checksums first (:func:`verify_checkpoint`;
    a directory without ``checksums.json`` is not checked) and every rank takes its verdict.

    Raises:
        CheckpointDamaged: a file differs from what was written (on every rank), naming it.
        CheckpointError: naming the entries that the checkpoint lacks or that differ in shape.
    """
    if verify:
        verdict: list = [None]
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # A directory without checksums.json (written before them, or by dcp.save itself) is
        # loaded as it is; rank 0 alone decides, so every rank takes the same branch.
        if (not multi or dist.get_rank() == 0) and _checksummed(Path(path)):
            try:
                intact_checkpoint(path)
            except CheckpointError as err:
                verdict[0] = err
        if multi:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise verdict[0]
    try:
        target = in_saved_layout(state, path)
        dcp.load(target, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
        state.update({top: sub for top, sub in target.items() if top not in ("model", "optimizer")})
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises several types
        if isinstance(err, CheckpointException):
            unsafe = [e for e, _ in err.failures.values() if isinstance(e, CheckpointError)]
            if unsafe:
                raise unsafe[0] from None
        if isinstance(err, CheckpointError):
            raise
        errors = [e for e, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
        if any(_is_damage(e) for e in errors):
            e = next(e for e in errors if _is_damage(e))
            older = [
                p.name
                for p in sorted(Path(path).parent.glob("step_*"), reverse=True)
                if is_complete(p) and p.name != Path(path).name
            ]
            raise CheckpointError(
                f"checkpoint {path} is damaged: a shard file cannot be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:300] if str(e) else 'no detail'}). "
                + (
                    f"Resume from an older one, e.g. --resume {Path(path).parent / older[0]}"
                    if older
                    else "No older complete checkpoint is left; start again."
                )
            ) from None
        text = str(err)
        lines = [
            ln.strip()
            for ln in text.splitlines()
            if "Missing key" in ln or "size mismatch" in ln.lower() or "shape" in ln.lower()
        ]
        detail = "; ".join(dict.fromkeys(lines))[:1500] or text[:1500]
        raise CheckpointError(
            f"checkpoint {path} does not fit this model/optimizer: {detail}. A checkpoint resumes only "
            "the same model config (tables, dims, optimizers); sharding and world size may differ."
        ) from None


def _checksummed(path: Path) -> bool:
    """Whether a checkpoint directory has, or was written with, a ``checksums.json``."""
    if (path / CHECKSUMS_FILE).is_file():
        return True
    try:
        return json.loads((path / "meta.json").read_text()).get("checksums") == CHECKSUMS_FILE
    except (OSError, ValueError, AttributeError):
        return (path / "meta.json").is_file()  # a garbled meta.json: verification names it


def _is_damage(err: BaseException) -> bool:
    """A shard file that is truncated or overwritten, as opposed to a model that differs."""
    text = str(err).lower()
    return isinstance(err, (EOFError, pickle.UnpicklingError, OSError)) or any(
        w in text
        for w in (
            "unpickl",
            "truncat",
            "pytorchstreamreader",
            "invalid load key",
            "ran out of input",
            "file not found",
            "no such file",
        )
    )


# Everything DCP's own ``.metadata`` pickle may name (torch 2.13): its metadata dataclasses,
# torch.Size, dtypes, layouts and the path of the checkpoint. Nothing else is constructed.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        allowed = name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise CheckpointError(
                f"{self._path}: refusing to load {module}.{name}; a DCP .metadata file holds only checkpoint "
                "metadata, so this file was not written by recsys_dist / torch.distributed.checkpoint. "
                "Load checkpoints only from sources you trust."
            )
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` pickle may construct only DCP's metadata types.

    DCP stores its checkpoint index as a pickle; a plain ``pickle.load`` of a tampered file
    could run arbitrary code. Tensor data is read by DCP with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: the metadata names any other class or function, or is not a pickle.
    """

    def read_metadata(self, *args, **kwargs):
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes()), path).load()
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - truncated or garbage files fail in many ways
            raise CheckpointError(
                f"{path}: not a readable DCP metadata file ({type(err).__name__}: {err}); "
                "the checkpoint is damaged, resume from an older one"
            ) from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``
    (DCP's default unpickles them fully)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# torch optimizers' state names -> the fused (FBGEMM) names, so a table's optimizer state
# is saved under one name whichever way it is sharded (data-parallel tables use torch
# optimizers; model-parallel ones FBGEMM's fused kernels).
_TORCH_TO_FUSED = {"sum": "momentum1", "exp_avg": "momentum1", "exp_avg_sq": "momentum2"}


def canonical_optimizer_state(optimizer_state: dict) -> dict:
    """``optimizer.state_dict()`` re-keyed so that fused and replicated tables agree.

    For every parameter: fused entries ``"<table>.momentum1"`` become ``"momentum1"``;
    torch entries ``sum`` / ``exp_avg`` / ``exp_avg_sq`` become ``momentum1`` / ``momentum2``,
    row-wise sums ``[rows, 1]`` are viewed as ``[rows]``; ``step`` counters are left out (the
    global step is in meta.json). Values are views of the live state, so loading a checkpoint
    into this dict in place restores the optimizers directly.
    """
    out = {}
    for param, entries in optimizer_state["state"].items():
        table = param.rsplit(".", 2)[-2] if param.endswith(".weight") else None
        canon = {}
        for name, value in entries.items():
            if name == "step":
                continue
            if table and name.startswith(table + "."):
                name = name[len(table) + 1 :]
            name = _TORCH_TO_FUSED.get(name, name)
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == 1:
                value = value.view(-1)
            canon[name] = value
        if canon:
            out[param] = canon
    return out


def set_optimizer_steps(optimizer, step: int) -> None:
    """Set torch optimizers' ``step`` counters (not checkpointed) to the global step."""
    for state in optimizer.state.values():
        if isinstance(state, dict) and "step" in state and isinstance(state["step"], torch.Tensor):
            state["step"].fill_(step)
