"""``metrics.jsonl``: one JSON object per line, written by rank 0, mirrored to TensorBoard.

Lines carry ``split`` (train / validation / test), ``step`` and ``epoch``, then the numbers
(the README lists them). Non-finite floats are written as ``null``, so the file stays strict
JSON (AUC is undefined on a split with one class).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    """Rank 0 appends one JSON object per line to ``metrics.jsonl``, and mirrors every
    number to TensorBoard (``RUN_DIR/tensorboard``) when the ``tensorboard`` package is
    installed (``pip install recsys_dist[tensorboard]``).

    Args:
        path: the ``metrics.jsonl`` file; its folder must exist when writing.
        enabled: False on every rank but rank 0 (then nothing is written).
    """

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(path.parent / "tensorboard"))
            except ImportError:
                pass

    def truncate_after(self, step: int) -> None:
        """Drop lines past ``step``: a resumed run writes them again, each step exactly once."""
        if self.enabled and self.path.is_file():
            keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            self.path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, **record) -> None:
        """Append ``record`` (``split``, ``step``, ``epoch`` and numbers) as one line."""
        if not self.enabled:
            return
        record = finite_or_none(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])
            self.tb.flush()

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
