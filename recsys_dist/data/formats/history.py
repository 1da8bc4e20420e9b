"""User histories for ``data.schema.history``: per row, the same user's earlier items,
computed while the file streams by (see :class:`UserHistory`)."""

from __future__ import annotations

from collections import deque

import numpy as np

from recsys_dist.errors import DataError


def is_parquet(spec, path: str) -> bool:
    """Whether a schema format reads ``path`` as Parquet (``file_type``, or auto by its name)."""
    return spec.file_type == "parquet" or (spec.file_type == "auto" and str(path).endswith((".parquet", ".pq")))


def _exact(t: float) -> str:
    """A time as written: integers as integers (``978300760``, not ``9.783e+08``), others in
    the shortest form that reads back as the same float."""
    return str(int(t)) if t.is_integer() else repr(t)


def describe(h) -> str:
    """The manifest's ``transforms`` entry of the history ``h`` (``data.schema.history``)."""
    if h.ties == "exclude":
        order = f"(time {h.time} strictly smaller; ties excluded)"
    else:
        order = f"in ({h.time}, file order)"
    return (
        f"{h.name}: the {h.item} values of the same {h.user}'s earlier rows {order}, the last {h.max_length}, "
        "oldest first, each mapped like a categorical value; list<int64>"
    )


class UserHistory:
    """Streaming user histories: per user, the last N item keys of rows strictly earlier in time.

    Memory: per user at most N committed keys plus the keys of that user's rows at the
    current (latest) time, whatever the length of the log. Rows of one user must come in
    non-decreasing time order. ``ties``: ``"exclude"``: rows of one user with equal times do
    not see each other (an event enters the history once a strictly later time of that user
    is seen); ``"file_order"``: an event enters the history of the user's next row, so a row
    reads every earlier row of its user in (time, file order).
    """

    def __init__(self, max_length: int, ties: str = "exclude") -> None:
        self.max_length = max_length
        self.in_order = ties == "file_order"
        self.state: dict[int, tuple[deque, float, list]] = {}
        self._last: tuple[str, int] | None = None

    def rows(self, path, first_line, users, items, present, times, h, spec) -> tuple[np.ndarray, np.ndarray]:
        # A new pass over the file (the vocabulary count, then the conversion) starts afresh.
        if self._last is None or self._last[0] != path or first_line <= self._last[1]:
            self.state = {}
        self._last = (path, first_line)
        out: list[int] = []
        lengths = np.zeros(len(users), np.int32)
        n = self.max_length
        for i, (u, t) in enumerate(zip(users.tolist(), times.tolist())):
            committed, at, pending = self.state.get(u) or (deque(maxlen=n), -np.inf, [])
            if t < at:
                raise DataError(
                    f"{path}, {'row' if is_parquet(spec, path) else 'line'} {first_line + i}, column {h.time}: "
                    f"{_exact(t)} is earlier than {_exact(at)} of an earlier row of the same {h.user}; data.schema.history "
                    f"needs each user's rows in non-decreasing {h.time} order (sort the log by {h.user}, {h.time} "
                    "or by time)"
                )
            if t > at or self.in_order:  # the pending events are now earlier than this row
                committed.extend(pending)
                pending, at = [], t
            out.extend(committed)
            lengths[i] = len(committed)
            if present[i]:
                pending.append(int(items[i]))
            self.state[u] = (committed, at, pending)
        return np.array(out, dtype=np.uint64), lengths
