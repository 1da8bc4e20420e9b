"""Where a stream run is, and how that is kept across restarts (``recsys_dist.train.stream``).

:class:`StreamState` is recorded in every checkpoint (``meta.json`` ``stream``). What changes
it without a training step (a partition quarantined, an empty one consumed) is written beside
the checkpoint of that step (:func:`record_between`, ``step_N/stream.json``), so a resume does
not read such a partition again. A stop (SIGTERM) inside a logging window saves the window's
per-step losses with the checkpoint (:func:`open_window`) and the resumed run continues it
(:func:`resume_window`), so ``metrics.jsonl`` has the lines and numbers of an uninterrupted run.
Under ``data.stream.histories: carry`` each checkpoint holds the users' histories after the
partitions it records as consumed (``step_N/histories.npz``, listed in its ``checksums.json``:
:func:`histories_file`, :func:`load_histories`).
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from recsys_dist.data.formats.history import load_state, save_state
from recsys_dist.errors import CheckpointError
from recsys_dist.files import write_atomic

log = logging.getLogger("recsys_dist")
BETWEEN_FILE = "stream.json"  # in a checkpoint directory: its stream state after what followed it at its step
HISTORIES_FILE = "histories.npz"  # in a checkpoint directory: the users' histories after the partitions consumed


@dataclass
class StreamState:
    """Where a stream run is (``meta.json`` ``stream`` of each checkpoint).

    Attributes:
        consumed: partitions trained to their end (or empty), in the order taken.
        quarantined: malformed partitions -> their error.
        current: the partition being scored / trained, or None between partitions.
        validated: ``current`` has been scored (its progressive-validation line written).
        batches: global batches of ``current`` trained.
        global_batch: rows per global batch the batches count.
        counters_at_start: the managed-collision counters when ``current`` started.
        current_file: ``current``'s [rows, bytes] when it was opened (a resume inside it checks them).
        path: ``data.stream.path`` (absolute) the names are below.
        files: name -> [size in bytes, mtime in ns] of the file as it was read, for the consumed,
            quarantined and current partitions (a later change is warned about, or retried).
        skipped: name -> bad rows left out of it (``data.on_bad_row: skip``), partitions with any.
    """

    consumed: list[str] = field(default_factory=list)
    quarantined: dict[str, str] = field(default_factory=dict)
    current: str | None = None
    validated: bool = False
    batches: int = 0
    global_batch: int = 0
    counters_at_start: dict = field(default_factory=dict)
    current_file: list | None = None
    path: str | None = None
    files: dict[str, list[int]] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def index(self) -> int:
        """The ordinal of ``current`` among the partitions trained (its ``epoch`` in metrics)."""
        return len(self.consumed)

    def due(self, name: str, file_id: list[int]) -> bool:
        """Whether the landed file ``name`` is to be taken: new, or quarantined and changed since."""
        if name in self.quarantined:
            return name in self.files and self.files[name] != file_id
        return name not in self.consumed

    def accounts_for(self, line: dict) -> bool:
        """Whether a ``metrics.jsonl`` line naming a partition is this state's doing."""
        name, split = line.get("partition"), line.get("split")
        if split == "validation":
            return name in self.consumed or (name == self.current and self.validated)
        if split == "quarantine":  # a partition quarantined, then retried and trained, keeps its line
            return name in self.quarantined or name in self.consumed
        return name in self.consumed


def record_between(checkpoint: Path, step: int, state: StreamState) -> None:
    """Write ``state`` beside ``checkpoint`` (of ``step``; rank 0): what changed at that step
    after it was saved. A failure is a warning: a resume then reads those partitions again."""
    target = checkpoint / BETWEEN_FILE
    try:  # a new file renamed over it: a link planted at the target (or a guessable tmp name) is not written through
        write_atomic(target, json.dumps({"step": step, "stream": asdict(state)}))
    except OSError as err:  # UnsafeFile too (a directory there)
        log.warning(
            "data.stream: could not record the stream's position in %s (%s); a resume from it reads the "
            "partitions quarantined or empty since then again",
            target,
            err,
        )


def restored_state(checkpoint: Path, meta: dict) -> StreamState:
    """The stream state to resume from ``checkpoint``: its ``meta.json``'s, or the one recorded
    beside it at its step (:func:`record_between`) when that one follows from it."""
    state = StreamState(**meta["stream"])
    path = checkpoint / BETWEEN_FILE
    if not path.is_file():
        return state
    try:
        saved = json.loads(path.read_text())
        later = StreamState(**saved["stream"])
        follows = saved["step"] == meta["step"] and state.current is None
        follows = follows and later.consumed[: len(state.consumed)] == state.consumed
    except (OSError, ValueError, TypeError, KeyError) as err:
        later, follows = None, False
        log.warning("data.stream: %s is unreadable (%s); ignored", path, err)
    if not follows:
        log.warning("data.stream: %s does not follow from the checkpoint's own position; ignored", path)
        return state
    return later


def open_window(losses: list[torch.Tensor], real_rows: list[torch.Tensor], seconds: float, world_size: int) -> dict:
    """A logging window left open by a stop, as a checkpoint records it (``meta.json``
    ``window``): every rank's per-step losses (``[steps]`` or ``[steps, 1 + tasks]`` as lists),
    its rows (sample weight > 0) and the window's seconds so far. Collective (one all_gather)."""
    mine = {
        "losses": torch.stack(losses).float().tolist(),
        "rows": int((torch.cat(real_rows) > 0).sum()) if real_rows else 0,
    }
    ranks = [mine]
    if world_size > 1:
        ranks = [None] * world_size
        dist.all_gather_object(ranks, mine)
    return {"ranks": ranks, "seconds": seconds}


def resume_window(
    window: dict, rank: int, world_size: int, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """This rank's (losses, real rows, seconds) of a window :func:`open_window` saved, on
    ``device``: on the same world size its own steps' values (the next train line is then the
    uninterrupted run's, bit for bit); on another, every rank gets the global mean of each step
    and rank 0 the rows (the same line, to rounding)."""
    ranks = window["ranks"]
    if len(ranks) == world_size:
        mine = ranks[rank]
        losses = torch.tensor(mine["losses"], dtype=torch.float32)
        rows = mine["rows"]
    else:
        losses = torch.tensor([r["losses"] for r in ranks], dtype=torch.float32).mean(dim=0)
        rows = sum(r["rows"] for r in ranks) if rank == 0 else 0
    return list(losses.to(device).unbind(0)), [torch.ones(rows, device=device)], float(window["seconds"])


def _history_key(h) -> str:
    return json.dumps(h.model_dump(mode="json"), sort_keys=True)


def histories_file(state: dict, h) -> bytes:
    """The carried history ``state`` (``data.schema.history`` ``h``) as a checkpoint's
    ``histories.npz`` holds it (``formats.history.save_state``)."""
    f = io.BytesIO()
    save_state(state, h.max_length, h.ties, _history_key(h), f)
    return f.getvalue()


def load_histories(checkpoint: Path, h) -> dict:
    """The carried history state a stream checkpoint holds (``histories.npz``), for
    ``data.schema.history`` ``h``.

    Raises:
        CheckpointError: the file is missing (a checkpoint of a run under
            ``data.stream.histories: per_partition``, or of a recsys_dist before carrying), unreadable,
            or derived under another history section; names the file and the fix.
    """
    path = checkpoint / HISTORIES_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing: the checkpoint holds no user histories (its run derived them per partition, "
            "data.stream.histories: per_partition, or predates carrying them), so the partitions it trained "
            "cannot be carried on. Resume it with data.stream.histories=per_partition, or start a new run "
            "(another --run-dir) to carry histories from the first partition"
        )
    try:
        return load_state(path, h.max_length, h.ties, _history_key(h))
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{path}: the carried user histories cannot be used: {err}. Resume from another checkpoint "
            "(--resume CHECKPOINT_DIR) with the data.schema.history it was trained with, or start a new run"
        ) from None
