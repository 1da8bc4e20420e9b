"""User histories for ``data.schema.history``: per row, the same user's earlier items,
computed while the file streams by (see :class:`UserHistory`)."""

from __future__ import annotations

import math
import zipfile
from collections import deque
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_dist.data.mapping import SparseKeys, text_keys
from recsys_dist.data.text import LINE_COLUMN
from recsys_dist.errors import DataError


def is_parquet(spec, path: str) -> bool:
    """Whether a schema format reads ``path`` as Parquet (``file_type``, or auto by its name)."""
    return spec.file_type == "parquet" or (spec.file_type == "auto" and str(path).endswith((".parquet", ".pq")))


def _exact(t: float) -> str:
    """A time as written: integers as integers (``978300760``, not ``9.783e+08``), others in
    the shortest form that reads back as the same float."""
    return str(int(t)) if t.is_integer() else repr(t)


def history_sequences(h) -> list[str]:
    """The sequence features (with a table) ``data.schema.history`` ``h`` derives: its items, and
    ``<name>_action`` with an action column; [] without a history."""
    if h is None:
        return []
    return [h.name] + ([f"{h.name}_action"] if getattr(h, "action", None) else [])


def drop_defaults(key: dict | None) -> None:
    """Remove ``action`` (with ``action_values``) / ``times`` from a history section's cache key
    where they are off, and ``ties`` where it is the default ``exclude`` (the keys of conversions
    from before them)."""
    if not isinstance(key, dict):
        return
    if not key.get("action"):
        key.pop("action_values", None)  # read only with an action column
    for option in ("action", "times"):
        if not key.get(option):
            key.pop(option, None)
    if key.get("ties") == "exclude":
        key.pop("ties")


def history_columns(h) -> list[str]:
    """The raw columns ``data.schema.history`` ``h`` reads: user, item, time (and action)."""
    return [h.user, h.item, h.time] + ([h.action] if getattr(h, "action", None) else [])


def without_label(spec, names: list[str]) -> list[str]:
    """``names`` (``data.schema.columns``) without the label column, unless it is the history's
    action column (the rating): a row to score still holds it, as its event's action."""
    keep = spec.history.action if spec.history is not None else None
    return [c for c in names if c != spec.label or c == keep]


class UserHistory:
    """Streaming user histories: per user, the last N events (item key, time, action key) of rows
    strictly earlier in time.

    Memory: per user at most N committed events plus the events of that user's rows at the
    current (latest) time, whatever the length of the log. Rows of one user must come in
    non-decreasing time order. ``ties``: ``"exclude"``: rows of one user with equal times do
    not see each other (an event enters the history once a strictly later time of that user
    is seen); ``"file_order"``: an event enters the history of the user's next row, so a row
    reads every earlier row of its user in (time, file order).
    """

    def __init__(self, max_length: int, ties: str = "exclude", carried: dict | None = None) -> None:
        self.max_length = max_length
        self.in_order = ties == "file_order"
        # user key -> ((item keys, times, action keys) of the last N committed events, the
        # user's latest time, its events at that time not committed yet: [(item, time, action)])
        self.state: dict[int, tuple[tuple[deque, deque, deque], float, list]] = {}
        # where each pass starts (data.stream.histories: carry: the partitions trained before);
        # copied per pass, never changed, so a partition that fails leaves it as it was
        self.carried: dict = carried if carried is not None else {}
        self._last: tuple[str, int] | None = None

    def passed(self) -> bool:
        """Whether a pass has read rows (``state`` is then the state after the last one)."""
        return self._last is not None

    def rows(self, path, first_line, users, items, present, times, h, spec, actions=None, lines=None) -> HistoryRows:
        """Per row of the block, the user's history before it (:class:`HistoryRows`).

        ``users``/``items`` uint64 keys [N], ``present`` bool [N] (False: the row's item is
        empty and joins no history), ``times`` float64 [N], ``actions`` uint64 keys [N] (the
        ``data.schema.history.action`` column's) or None, ``lines`` int64 [N] the rows' file lines
        (:func:`file_lines`) or None (row i is on line ``first_line + i``).

        Raises:
            DataError: a row's time is earlier than an earlier row's of the same user (names the
                file, line/row and column).
        """
        # A new pass over the file (the vocabulary count, then the conversion) starts afresh,
        # from the carried state (the partitions before, data.stream.histories: carry).
        if self._last is None or self._last[0] != path or first_line <= self._last[1]:
            self.state = copy_state(self.carried)
        self._last = (path, first_line)
        keys: list[int] = []
        when: list[float] = []
        what: list[int] = []
        lengths = np.zeros(len(users), np.int32)
        n = self.max_length
        acts = actions.tolist() if actions is not None else [0] * len(users)
        for i, (u, t) in enumerate(zip(users.tolist(), times.tolist())):
            # (item keys, their times, their action keys): the user's last n committed events
            committed, at, pending = self.state.get(u) or (
                (deque(maxlen=n), deque(maxlen=n), deque(maxlen=n)),
                -np.inf,
                [],
            )
            if t < at and u in self.carried:  # late data: its user has later events trained already
                raise DataError(
                    f"{where(spec, path, first_line, i, lines)}, column {h.time}: {_exact(t)} is earlier than "
                    f"{_exact(at)} of an earlier row of the same {h.user}, of this file or of a partition trained "
                    "before (data.stream.histories: carry keeps each user's events across partitions): a late "
                    "row's history cannot be what it would be in time order; leave late rows out of the partition "
                    "(docs/online.md, 'User histories')"
                )
            if t < at:
                raise DataError(
                    f"{where(spec, path, first_line, i, lines)}, column {h.time}: "
                    f"{_exact(t)} is earlier than {_exact(at)} of an earlier row of the same {h.user}; data.schema.history "
                    f"needs each user's rows in non-decreasing {h.time} order (sort the log by {h.user}, {h.time} "
                    "or by time)"
                )
            if t > at or self.in_order:  # the pending events are now earlier than this row
                for event in pending:
                    for column, value in zip(committed, event):
                        column.append(value)
                pending, at = [], t
            keys.extend(committed[0])
            when.extend(committed[1])
            what.extend(committed[2])
            lengths[i] = len(committed[0])
            if present[i]:
                pending.append((int(items[i]), t, acts[i]))
            self.state[u] = (committed, at, pending)
        return HistoryRows(
            np.array(keys, dtype=np.uint64),
            lengths,
            np.array(when, dtype=np.float64),
            np.array(what, dtype=np.uint64),
        )


def copy_state(state: dict) -> dict:
    """A copy of a :class:`UserHistory` ``state`` that shares nothing mutable with it."""
    return {
        u: (tuple(deque(c, maxlen=c.maxlen) for c in committed), at, list(pending))
        for u, (committed, at, pending) in state.items()
    }


STATE_FORMAT = 1  # of the arrays save_state writes


def save_state(state: dict, max_length: int, ties: str, key: str, f) -> None:
    """Write a :class:`UserHistory` ``state`` into the binary file object ``f`` (a NumPy
    ``.npz``: per user its key (uint64), latest time (float64), committed and pending event
    counts (int32); per event, user by user, committed first, oldest first: item key (uint64),
    time (float64), action key (uint64); and ``max_length``, ``ties`` and ``key`` (the
    ``data.schema.history`` section as JSON) it was derived under). Exact: every value is kept
    in its own dtype. Size: O(users x max_length)."""
    users = np.fromiter(state.keys(), np.uint64, len(state))
    at = np.fromiter((v[1] for v in state.values()), np.float64, len(state))
    committed = np.fromiter((len(v[0][0]) for v in state.values()), np.int32, len(state))
    pending = np.fromiter((len(v[2]) for v in state.values()), np.int32, len(state))
    items, times, actions = [], [], []
    for (ks, ts, acts), _, waiting in state.values():
        items.extend(ks)
        times.extend(ts)
        actions.extend(acts)
        for item, t, action in waiting:
            items.append(item)
            times.append(t)
            actions.append(action)
    np.savez(
        f,
        format=np.int64(STATE_FORMAT),
        max_length=np.int64(max_length),
        ties=np.str_(ties),
        key=np.str_(key),
        users=users,
        at=at,
        committed=committed,
        pending=pending,
        items=np.array(items, np.uint64),
        times=np.array(times, np.float64),
        actions=np.array(actions, np.uint64),
    )


def load_state(f, max_length: int, ties: str, key: str) -> dict:
    """The :class:`UserHistory` state :func:`save_state` wrote into ``f`` (a path or binary file).

    Raises:
        ValueError: the file is not such a state (unreadable, damaged, another format), or it
            was derived under another ``max_length`` / ``ties`` / history section (``key``):
            the message says which.
    """
    try:
        with np.load(f, allow_pickle=False) as z:
            got = {name: z[name] for name in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"not a saved history state ({type(err).__name__}: {err})") from None
    names = ("format", "max_length", "ties", "key", "users", "at", "committed", "pending", "items", "times", "actions")
    if set(got) != set(names) or int(got["format"]) != STATE_FORMAT:
        raise ValueError(f"not a history state of format {STATE_FORMAT} (arrays {sorted(got)})")
    if str(got["key"]) != key:
        raise ValueError(f"derived under data.schema.history {got['key']}, the config has {key}")
    if int(got["max_length"]) != max_length or str(got["ties"]) != ties:  # part of the key; said plainly
        raise ValueError(f"derived with max_length {int(got['max_length'])}, ties {got['ties']}")
    counts = got["committed"].astype(np.int64) + got["pending"]
    n = len(got["users"])
    if not all(len(got[a]) == n for a in ("at", "committed", "pending")) or any(
        len(got[a]) != int(counts.sum()) for a in ("items", "times", "actions")
    ):
        raise ValueError("its arrays' lengths do not agree (damaged)")
    if (got["committed"] > max_length).any() or (counts < 0).any():
        raise ValueError(f"a user holds more than max_length {max_length} events (damaged)")
    state, start = {}, 0
    items, times, actions = got["items"].tolist(), got["times"].tolist(), got["actions"].tolist()
    for u, at, c, p in zip(
        got["users"].tolist(), got["at"].tolist(), got["committed"].tolist(), got["pending"].tolist()
    ):
        mid, end = start + c, start + c + p
        committed = tuple(deque(col[start:mid], maxlen=max_length) for col in (items, times, actions))
        state[u] = (committed, at, list(zip(items[mid:end], times[mid:end], actions[mid:end])))
        start = end
    return state


class HistoryRows(NamedTuple):
    """The histories of a block of N rows, flat (row by row, oldest event first).

    Attributes:
        keys: uint64 [sum(lengths)]: the events' item keys.
        lengths: int32 [N]: events per row (at most ``max_length``).
        times: float64 [sum(lengths)]: each event's time (the ``data.schema.history.time`` value
            of the row it came from), non-decreasing within a row and strictly below the row's
            (at most the row's under ``ties: file_order``).
        actions: uint64 [sum(lengths)]: each event's action key (0 without an action column).
    """

    keys: np.ndarray
    lengths: np.ndarray
    times: np.ndarray
    actions: np.ndarray


def time_deltas(row_times: np.ndarray, lengths: np.ndarray, event_times: np.ndarray) -> np.ndarray:
    """uint64 [sum(lengths)]: per history event, ``floor(row time - event time)`` (in the time
    column's units, >= 0: an event is strictly earlier than its row), the value of the derived
    ``<history>_time`` feature (``data.schema.history.times``)."""
    return np.floor(np.repeat(row_times, lengths) - event_times).astype(np.uint64)


def history_transform(h) -> str:
    """What the history's columns hold, as text for the manifest."""
    if getattr(h, "ties", "exclude") == "exclude":
        order = f"(time {h.time} strictly smaller; ties excluded)"
    else:
        order = f"in ({h.time}, file order)"
    out = (
        f"{h.name}: the {h.item} values of the same {h.user}'s earlier rows {order}, the last {h.max_length}, "
        "oldest first, each mapped like a categorical value; list<int64>"
    )
    if getattr(h, "action", None):
        out += f"; {h.name}_action: those rows' {h.action} values (numbers as repr(float)), mapped like a categorical"
    if getattr(h, "times", False):
        out += f"; {h.name}_time: per event 1 + floor(row {h.time} - event {h.time}) as int64 (raw, no table)"
    return out


def _keys(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    return text_keys(pc.utf8_trim_whitespace(pc.fill_null(col, "")))


EXACT_FLOAT = 2**53  # every integer of magnitude <= 2^53 is a distinct float64


def _number_text(value: str) -> str | None:
    """The key text of number ``value``: ``repr(float(value))``, except an integer written with
    digits beyond 2^53 in magnitude, keyed by its own digits (float64 would merge 2^53 + 1 into
    2^53: two actions into one), and -0 as 0. None where ``value`` is not a number; Python's
    digit separators (``1_0``) are not one (no CSV, JSON or Parquet writer writes them: a typo,
    read as 10 before)."""
    if "_" in value:
        return None
    try:
        whole = int(value)
    except ValueError:
        whole = None
    if whole is not None and abs(whole) > EXACT_FLOAT:
        return str(whole)
    try:
        number = float(value)
    except ValueError:
        return None
    if math.isfinite(number) and abs(number) > EXACT_FLOAT and number.is_integer():
        return str(int(number))  # a float's text ("1e+17"): the integer it is, as an int column writes it
    return repr(number + 0.0)  # -0.0 + 0.0 is 0.0: "-0" is the value 0, not an action of its own


def action_keys(col: pa.Array, numbers: bool = False) -> np.ndarray:
    """uint64 [N]: the key of each action value's text, a number written as ``repr(float)`` (an
    integer beyond 2^53 as its digits, :func:`_number_text`): the
    rating 4, "4", 4.0 and "4.00" (a JSON client, a Parquet double, a CSV field) are one action.
    An empty or null value is the action "" (its own key).

    Raises:
        NotANumber: ``numbers`` (``data.schema.history.action_values: numbers``) and a non-empty
            value that is not a number; it holds the row index and the value. Without this check
            such a value (a typo, "four") became an action of its own that no training row held,
            so a request scored it as the unknown action.
    """
    text = pc.utf8_trim_whitespace(pc.fill_null(pc.cast(col, pa.string()), "")).to_pylist()
    keyed = []
    for i, v in enumerate(text):
        k = _number_text(v) if v else v
        if k is None and numbers:
            raise NotANumber(i, v)
        keyed.append(v if k is None else k)
    return text_keys(pa.array(keyed, pa.string()))[0]


class NotANumber(ValueError):
    """An action value that is not a number (:func:`action_keys`): ``args`` (row index, value)."""


def file_lines(batch: pa.RecordBatch) -> np.ndarray | None:
    """int64 [N]: each row's file line, where the reader recorded it (``data.on_bad_row: skip``:
    rows left out before a row shift its place in the block), else None (row i of a block is on
    line ``first_line + i``)."""
    if LINE_COLUMN not in batch.schema.names:
        return None
    return batch.column(LINE_COLUMN).to_numpy(zero_copy_only=False)


def where(spec, path, first_line: int, i: int, lines: np.ndarray | None = None) -> str:
    """``"PATH, line N"`` (``row N`` in Parquet) of row ``i`` of a block whose first row is on
    ``first_line``; ``lines`` (:func:`file_lines`) when given."""
    line = first_line + i if lines is None else int(lines[i])
    return f"{path}, {'row' if is_parquet(spec, path) else 'line'} {line}"


def derive_features(state: UserHistory, h, batch: pa.RecordBatch, times: np.ndarray, path, first_line, spec):
    """The history's features of a block (``times`` float64 [N], the rows' checked times):
    its items, then (if configured) the events' actions and their times before the row
    (:func:`time_deltas`), as ``SparseKeys`` (list).

    Raises:
        DataError: a row without a user (empty, blank or null), or an action that is not a number
            (``data.schema.history.action_values: numbers``), naming the line / row and column;
            as ``UserHistory.rows``."""
    lines = file_lines(batch)
    users, known = _keys(batch.column(h.user))
    if not known.all():  # rows without a user would all share the history of one user ""
        i = int(np.flatnonzero(~known)[0])
        raise DataError(
            f"{where(spec, path, first_line, i, lines)}, column {h.user}: empty "
            f"(data.schema.history.user needs a user on every row; rows without one would share one history)"
        )
    items, present = _keys(batch.column(h.item))
    actions = _actions(h, batch, path, first_line, spec, lines) if getattr(h, "action", None) else None
    got = state.rows(path, first_line, users, items, present, times, h, spec, actions, lines)
    out = [SparseKeys(got.keys, None, got.lengths)]
    if actions is not None:
        out.append(SparseKeys(got.actions, None, got.lengths))
    if getattr(h, "times", False):
        out.append(SparseKeys(time_deltas(times, got.lengths, got.times), None, got.lengths))
    return out


def _actions(h, batch: pa.RecordBatch, path, first_line: int, spec, lines=None) -> np.ndarray:
    """The action keys of a block (:func:`action_keys`), a non-number a ``DataError``."""
    try:
        return action_keys(batch.column(h.action), getattr(h, "action_values", "numbers") == "numbers")
    except NotANumber as err:
        i, value = err.args
        raise DataError(
            f"{where(spec, path, first_line, i, lines)}, column {h.action}: {value!r} is not a number "
            f"(data.schema.history.action {h.action} holds numbers, e.g. the rating; set "
            "data.schema.history.action_values: text if the actions are categorical strings)"
        ) from None
