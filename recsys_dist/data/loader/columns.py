"""A window's rows as numpy columns (:class:`Columns`), and jagged-bag selection (:func:`take_bags`)."""

from __future__ import annotations

import numpy as np


def take_bags(
    lengths: np.ndarray, values: np.ndarray, idx: np.ndarray, offsets: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The bags of rows ``idx`` (int64, any order, repeats allowed) of a jagged feature
    ``(lengths int [N], values [sum(lengths)])``: ``(lengths[idx], their values concatenated)``,
    without a Python loop. ``offsets`` (``[0, cumsum(lengths)]``) may be passed when cached."""
    if offsets is None:
        offsets = np.concatenate([[0], np.cumsum(lengths)])
    sel = lengths[idx]
    starts = np.repeat(offsets[idx], sel)
    within = np.arange(sel.sum()) - np.repeat(np.cumsum(sel) - sel, sel)
    return sel, values[starts + within]


class Columns:
    """Columns of a set of rows, one numpy array per column (reading a window from Arrow is
    one copy per column), so a whole window is gathered into batch layout in one pass per column.

    ``labels`` float32 [n] (or [n, T], several tasks); ``weights`` float32 [n] sample weights or
    None (all 1); ``dense`` float32 [n, D] (row-major: gathering a row is one read);
    ``ids`` one entry per sparse
    feature in key order: int64 or int32 [n] (one-hot; int32 when the ids fit, see
    ``ParquetBatchLoader._read``) or (lengths int64 [n], values int64) (multi-hot).
    """

    def __init__(self, labels: np.ndarray, dense: list, ids: list, weights: np.ndarray | None = None) -> None:
        self.labels, self.dense, self.ids, self.weights = labels, dense, ids, weights
        self._offsets = {j: np.concatenate([[0], np.cumsum(c[0])]) for j, c in enumerate(ids) if isinstance(c, tuple)}

    def __len__(self) -> int:
        return len(self.labels)

    def _bags(self, j: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Multi-hot feature ``j`` of rows ``idx``: (lengths [len(idx)], their values concatenated)."""
        return take_bags(*self.ids[j], idx, self._offsets[j])

    def take(self, idx: np.ndarray) -> Columns:
        return Columns(
            self.labels[idx],
            self.dense[idx],
            [self._bags(j, idx) if isinstance(c, tuple) else c[idx] for j, c in enumerate(self.ids)],
            None if self.weights is None else self.weights[idx],
        )

    @staticmethod
    def concat(parts: list[Columns]) -> Columns:
        cat = np.concatenate
        first = parts[0]
        ids = [
            (cat([p.ids[j][0] for p in parts]), cat([p.ids[j][1] for p in parts]))
            if isinstance(c, tuple)
            else cat([p.ids[j] for p in parts])
            for j, c in enumerate(first.ids)
        ]
        weights = None if first.weights is None else cat([p.weights for p in parts])
        return Columns(cat([p.labels for p in parts]), cat([p.dense for p in parts]), ids, weights)
