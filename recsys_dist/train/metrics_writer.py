"""``metrics.jsonl``: one JSON object per line, written by rank 0, mirrored to TensorBoard.

Lines carry ``split`` (train / validation / test), ``step`` and ``epoch``, then the numbers
(the README lists them). Non-finite floats are written as ``null``, so the file stays strict
JSON (AUC is undefined on a split with one class).

Each (split, step) appears once, in order, whatever happened to the run: when the writer
starts (:meth:`MetricsWriter.start`) it keeps only the lines up to the step the run
continues from (none when it starts from scratch), so a restart, an elastic retry or
``--resume auto`` writes the later lines again instead of appending a second copy. A line
cut short by a full disk is removed at once; a torn last line found when reading (the
process died mid-write) is dropped with a warning (:func:`read_metrics`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from recsys_dist.checkpoint.meta import latest_checkpoint
from recsys_dist.errors import MetricsError  # noqa: F401 (raised here; defined in errors)
from recsys_dist.faults import maybe_fault
from recsys_dist.files import open_in_place, write_atomic

log = logging.getLogger("recsys_dist")


def read_metrics(path: str | Path) -> list[dict]:
    """The lines of a ``metrics.jsonl`` file, parsed, in file order.

    A last line that is not complete JSON (the writer died or the disk filled mid-line) is
    dropped with a warning; a damaged line anywhere else is an error.

    Raises:
        MetricsError: a line other than the last is not a JSON object, naming file and line.
        OSError: the file cannot be read.
    """
    path = Path(path)
    lines = path.read_text(errors="replace").splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not a metrics record (a JSON object with 'step')")
        except ValueError as err:
            if i == len(lines):
                log.warning("%s: dropped the incomplete last line %d (%s): %.80r", path, i, err, line)
                break
            raise MetricsError(
                f"{path}, line {i}: not a metrics record ({err}); only the last line may be cut short. "
                f"Delete or repair that line, then run again"
            ) from None
        records.append(record)
    return records


class MetricsWriter:
    """Rank 0 appends one JSON object per line to ``metrics.jsonl``, and mirrors every
    number to TensorBoard (``RUN_DIR/tensorboard``) when the ``tensorboard`` package is
    installed (``pip install recsys_dist[tensorboard]``).

    Args:
        path: the ``metrics.jsonl`` file; its folder must exist when writing.
        enabled: False on every rank but rank 0 (then nothing is written).
        world_size: the ranks that call :meth:`write` together. With more than one,
            :meth:`write` is collective: when rank 0 cannot write, every rank raises
            :class:`MetricsError` (no rank is left waiting in the next collective).
        resume_step: the step of the checkpoint a resumed run starts from: TensorBoard events
            after it are purged (``SummaryWriter(purge_step=resume_step + 1)``).
    """

    def __init__(self, path: Path, enabled: bool, world_size: int = 1, resume_step: int | None = None) -> None:
        self.path, self.enabled, self.world_size = Path(path), enabled, world_size
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # A resumed run writes the steps after its checkpoint again: TensorBoard drops
                # the old events from purge_step on, so each step shows once.
                purge = {} if resume_step is None else {"purge_step": resume_step + 1}
                self.tb = SummaryWriter(str(self.path.parent / "tensorboard"), **purge)
            except ImportError:
                pass

    def start(self, step: int, stale=None) -> None:
        """Keep the lines up to ``step`` (the checkpoint the run continues from; 0 when it
        starts from scratch, which empties the file): the run writes every later line again,
        so each (split, step) appears exactly once. The file is replaced atomically.
        ``stale``: a predicate on a line of ``step`` itself that the run writes again (a stream's
        partition scored after the checkpoint of that step was saved).

        Raises:
            MetricsError: the file cannot be rewritten, or holds a damaged line that is not
                the last one.
        """
        if not self.enabled or not (self.path.is_file() or self.path.is_symlink()):
            return
        # A symbolic link here (even a dangling one) is replaced by a file of its own below.
        keep = [r for r in read_metrics(self.path) if r["step"] <= step] if step > 0 and self.path.is_file() else []
        if stale is not None:  # lines of the checkpoint's own step that it does not account for
            keep = [r for r in keep if not (r["step"] == step and stale(r))]
        try:
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        except OSError as err:
            raise MetricsError(self._cannot_write(err, step)) from None
        if keep or step == 0:
            dropped = "every line" if step == 0 else f"the lines after step {step}"
            log.info("%s: kept %d line(s), dropped %s (written again by this run)", self.path, len(keep), dropped)

    def last(self, split: str) -> dict | None:
        """The newest line of ``split`` in the file (rank 0; None when there is none)."""
        if not self.enabled or not self.path.is_file():
            return None
        found = [r for r in read_metrics(self.path) if r.get("split") == split]
        return found[-1] if found else None

    def truncate_after(self, step: int) -> None:
        """The same as :meth:`start` (its former name)."""
        self.start(step)

    def write(self, **record) -> None:
        """Append ``record`` (``split``, ``step``, ``epoch`` and numbers) as one line.

        Raises:
            MetricsError: the line could not be written (on every rank when ``world_size``
                > 1); the file is left as it was before this line.
        """
        problem = 0
        if self.enabled:
            record = finite_or_none(record)
            try:
                self._append(json.dumps(record) + "\n", record.get("step", 0))
            except OSError as err:
                problem = err.errno or -1
                error = err
        if self.world_size > 1:
            import torch
            import torch.distributed as dist

            nccl = dist.get_backend() == "nccl"
            flag = torch.tensor([problem], dtype=torch.int64, device="cuda" if nccl else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # errno >= 0; any failure wins
            problem = int(flag[0])
        if problem:
            if not self.enabled:
                error = OSError(problem, os.strerror(problem) if problem > 0 else "write failed", str(self.path))
            raise MetricsError(self._cannot_write(error, record.get("step")))
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])
            self.tb.flush()

    def _append(self, line: str, step: int) -> None:
        """Write ``line`` whole or not at all: a short write is cut off again.

        Written with ``os.write`` on an unbuffered descriptor: a buffered file would keep the
        unwritten rest of the line in its buffer, and its ``truncate`` flushes that buffer
        first, which fails again on a full disk and leaves the torn line in the file."""
        data = line.encode()
        rank = 0 if self.enabled else -1
        fd = open_in_place(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            try:
                maybe_fault("metrics_full", step, rank, partial=lambda: os.write(fd, data[:17]))
                maybe_fault("read_only", step, rank)
                view = memoryview(data)
                while view:  # a short write (the disk filled mid-line) returns how much went
                    view = view[os.write(fd, view) :]
            except OSError:
                try:
                    os.ftruncate(fd, size)  # shrinking needs no free space
                except OSError:
                    pass  # then read_metrics drops the torn last line
                raise
        finally:
            os.close(fd)

    def _cannot_write(self, err: BaseException, step) -> str:

        run_dir = self.path.parent
        what = f"[Errno {err.errno}] {err.strerror}" if isinstance(err, OSError) and err.errno else str(err)
        latest = latest_checkpoint(run_dir)
        return (
            f"{self.path} could not be written at step {step} ({what}); every rank stopped. "
            f"The newest complete checkpoint: {latest or 'none yet (the run starts again from step 0)'}. "
            f"Free disk space or make the run directory writable, then continue with "
            f"--resume auto --run-dir {run_dir}."
        )

    def close(self) -> None:
        """Close the TensorBoard writer (the JSON file is closed after every line)."""
        if self.tb is not None and hasattr(self.tb, "close"):
            self.tb.close()
        self.tb = None


def finite_or_none(tree):
    """NaN / inf -> None in nested dicts, so the files stay strict JSON."""
    if isinstance(tree, dict):
        return {k: finite_or_none(v) for k, v in tree.items()}
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree
