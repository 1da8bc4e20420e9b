"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic saves, resume, reshard.

Layout of a run directory's ``checkpoints/``::

    step_00000120/      one DCP checkpoint: every rank's shards, .metadata, meta.json, the data
                        source's files (a stream's histories.npz), checksums.json (size and
                        CRC-32 of each of those files)
    latest              text file naming the newest complete checkpoint; written last
    best                (checkpoint.keep_best) text file naming the best-validation checkpoint,
                        which ``checkpoint.keep`` never deletes

A checkpoint is written into ``step_N.tmp`` and renamed by rank 0 once every rank has
finished, and ``latest`` is replaced (write + rename) only after that, so a crash mid-save
never leaves a half-written checkpoint as the newest one. Each rank checksums the shard
files it wrote; rank 0 writes every file's size and CRC-32 into ``checksums.json`` before
the rename, and ``recsys_dist.checkpoint.integrity.verify_checkpoint`` compares them before
anything is loaded (a shard overwritten in place, same size, is found; a damaged checkpoint
is named, never loaded). ``meta.json`` records the checkpoint format
(``recsys_dist.checkpoint.meta.CHECKPOINT_FORMAT``); a checkpoint of another one is refused.

What is saved: the model's sharded state dict (embedding shards, dense weights), the
optimizers' state (the fused embedding optimizer's per-row state as sharded tensors, the
dense optimizer's), each rank's torch RNG state, and in ``meta.json`` the step, epoch, batches
consumed in the epoch, world size, sharding plan and resolved config. DCP stores tensors
with their global offsets, so a checkpoint loads onto any world size or sharding plan
(resharding); an entry the new model has but the checkpoint lacks is an error naming it.
"""

from __future__ import annotations

import errno
import json
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.tensor import DTensor
from torchrec.distributed.shards_wrapper import LocalShardsWrapper

from recsys_dist.checkpoint.integrity import CHECKSUMS_FILE, describe_error, file_sum, intact_checkpoint, own_sums
from recsys_dist.checkpoint.meta import CHECKPOINT_FORMAT, is_complete, latest_checkpoint, marked_name
from recsys_dist.checkpoint.safe_read import SafeLoadPlanner, SafeReader
from recsys_dist.distributed.env import DistContext
from recsys_dist.errors import CheckpointDamaged, CheckpointError  # noqa: F401 (raised here; defined in errors)
from recsys_dist.faults import maybe_fault
from recsys_dist.files import fresh_dir, write_atomic


def save_checkpoint(
    ctx: DistContext,
    run_dir: Path,
    step: int,
    state: dict,
    meta: dict,
    keep: int = 2,
    best: bool = False,
    files: dict | None = None,
) -> Path:
    """Save ``state`` (nested dict of tensors / ShardedTensors) as checkpoint ``step``.

    Every rank must call this (it is collective). Keeps the newest ``keep`` checkpoints and
    the one ``checkpoints/best`` names; ``best``: this one becomes ``checkpoints/best``.
    ``files``: rank 0's, name -> a function that writes that file at the path it is given
    (``files.write_atomic``), written into the checkpoint before ``checksums.json``, which
    lists them (a stream's carried user histories). Returns the final checkpoint directory.

    Raises:
        CheckpointError: on every rank at once, when any rank cannot write (disk full,
            read-only or vanished directory, too little free space for the estimated size).
            The partial ``step_N.tmp`` is removed and the previous ``latest`` is left as it was.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    need = global_bytes(ctx, state)

    def prepare() -> None:
        if ctx.is_main:
            fresh_dir(tmp)  # a stale step_N.tmp, or a link planted there, is removed; never written through
            free = shutil.disk_usage(tmp).free
            if free < need * 1.05:
                raise OSError(
                    errno.ENOSPC, f"about {need / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB free", str(root)
                )

    sums: dict = {}

    def finish() -> None:
        if ctx.is_main:
            # The format tells a later recsys_dist what it reads (checksums.json always belongs to it).
            write_atomic(tmp / "meta.json", json.dumps({**meta, "checkpoint_format": CHECKPOINT_FORMAT}, indent=2))
            listed = {n: v for part in gathered for n, v in part.items()}
            for name, writer in (files or {}).items():
                write_atomic(tmp / name, writer)
                listed[name] = file_sum(tmp / name)
            listed["meta.json"] = file_sum(tmp / "meta.json")
            write_atomic(tmp / CHECKSUMS_FILE, json.dumps({"algorithm": "crc32", "files": listed}, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for name in ("latest", "best") if best else ("latest",):
                write_atomic(root / name, final.name + "\n")
            kept = marked_name(root, "best")
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
            raise _RankFailure(rank, describe_error(exc)) from None
        sums.update(own_sums(tmp, ctx.rank))  # the files this rank wrote, while they are in its page cache
        maybe_fault("save", step, ctx.rank)

    gathered: list = [sums]
    for stage in (prepare, write, finish):
        if stage is finish and ctx.world_size > 1:
            gathered = [None] * ctx.world_size
            dist.all_gather_object(gathered, sums)
        _on_all_ranks(ctx, stage, step, root, tmp)
    return final


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
        problem = (ctx.rank, describe_error(err))
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


def global_bytes(ctx: DistContext, state: dict) -> int:
    """Bytes this checkpoint will hold, summed over ranks: each rank counts its own shards; a plain
    tensor counts once per entry over the ranks (DCP writes a replicated one once, and one that
    only some ranks hold, a pipeline stage's weights, once too). One ``all_gather_object`` of the
    plain entries' sizes and one all-reduce."""
    total = 0
    plain: dict[str, int] = {}
    stack: list = [("", state)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{path}.{k}", x) for k, x in v.items())
        elif isinstance(v, ShardedTensor):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in v.local_shards())
        elif isinstance(v, DTensor) and isinstance(v.to_local(), LocalShardsWrapper):
            total += _replica_table_bytes(v)
        elif isinstance(v, torch.Tensor) and hasattr(v, "to_local"):  # a DTensor: this rank's shard
            t = v.to_local()
            total += t.numel() * t.element_size()
        elif isinstance(v, torch.Tensor):
            plain[path] = v.numel() * v.element_size()
    if ctx.world_size > 1:
        every: list = [None] * ctx.world_size
        dist.all_gather_object(every, plain)
        for entries in every:
            plain.update(entries)
        n = torch.tensor([total], dtype=torch.int64)
        dist.all_reduce(n)
        total = int(n)
    return total + sum(plain.values())


def _replica_table_bytes(v: DTensor) -> int:
    """This rank's bytes of a table under ``sharding.replica_groups`` (TorchRec's DMPCollection:
    a DTensor over its ("replicate", "shard") mesh holding a LocalShardsWrapper): DCP writes a
    shard once, not once per replica group, so only the first group's rank counts it."""
    mesh = v.device_mesh
    coord = mesh.get_coordinate() or []
    if any(c for c, name in zip(coord, mesh.mesh_dim_names or ()) if name == "replicate"):
        return 0
    return sum(s.numel() * s.element_size() for s in v.to_local().local_shards())


def load_checkpoint(path: Path, state: dict, verify: bool = True) -> None:
    """Load a checkpoint in place into ``state`` (the live model / optimizer state dicts).

    The target's sharding may differ from the one saved (resharding). Collective when a
    process group exists: with ``verify`` (default) rank 0 checks the checkpoint first
    (``recsys_dist.checkpoint.integrity.intact_checkpoint``: its format and every file's
    checksum) and every rank takes its verdict.

    Raises:
        CheckpointDamaged: a file differs from what was written (on every rank), naming it.
        CheckpointError: a checkpoint of another format; naming the entries that the checkpoint
            lacks or that differ in shape.
    """
    if verify:
        verdict: list = [None]
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not multi or dist.get_rank() == 0:  # rank 0 alone decides: every rank takes the same branch
            try:
                intact_checkpoint(path)
            except CheckpointError as err:
                verdict[0] = err
        if multi:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise verdict[0]
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises several types
        raise _load_failure(Path(path), err) from None


def _load_failure(path: Path, err: BaseException) -> CheckpointError:
    """The error to raise for a failed ``dcp.load`` of ``path``: the unpickler's refusal as
    it is, a damaged shard (naming an older checkpoint to resume from), else a model that
    does not fit (naming the missing or mis-shaped entries)."""
    if isinstance(err, CheckpointException):
        unsafe = [e for e, _ in err.failures.values() if isinstance(e, CheckpointError)]
        if unsafe:
            return unsafe[0]
    if isinstance(err, CheckpointError):
        return err
    errors = [e for e, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
    if any(_is_damage(e) for e in errors):
        e = next(e for e in errors if _is_damage(e))
        older = [p.name for p in sorted(path.parent.glob("step_*"), reverse=True) if is_complete(p) and p != path]
        return CheckpointError(
            f"checkpoint {path} is damaged: a shard file cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:300] if str(e) else 'no detail'}). "
            + (
                f"Resume from an older one, e.g. --resume {path.parent / older[0]}"
                if older
                else "No older complete checkpoint is left; start again."
            )
        )
    text = str(err)
    lines = [
        ln.strip()
        for ln in text.splitlines()
        if "Missing key" in ln or "size mismatch" in ln.lower() or "shape" in ln.lower()
    ]
    detail = "; ".join(dict.fromkeys(lines))[:1500] or text[:1500]
    return CheckpointError(
        f"checkpoint {path} does not fit this model/optimizer: {detail}. A checkpoint resumes only "
        "the same model config (tables, dims, optimizers); sharding and world size may differ."
    )


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
