"""Coverage of the embedding tables: how many of a feature's training values get a table row of
their own, and the table size that would give 95% / 99% of them one.

A feature's **training values** are its present (non-empty) values in the training split, one
per row for a one-hot column, one per element for a multi-hot or sequence column: the lookups
the model makes while training.

- ``vocabulary`` mapping: a value is **out of vocabulary** when its key is not among the kept
  keys (seen fewer than ``min_count`` times, or left out by the ``num_embeddings`` cap); all
  such values share row 1. ``outside_share`` = those values / training values, split into
  ``cut_by_size`` (seen ``min_count`` times or more: only the cap left them out) and
  ``below_min_count``. Exact: the counting pass's own counts. The suggested size for a share
  ``p`` is the smallest ``num_embeddings`` whose vocabulary holds at least ``p`` of the training
  values (2 + the number of most frequent keys needed; None when ``min_count`` alone leaves
  out more than ``1 - p``).
- ``hash`` mapping: a value **collides** when its row (``1 + key mod (n - 1)``) also receives
  another distinct training key. ``collided_share`` = those values / training values. Exact
  when the feature has at most :data:`SKETCH_KEYS` distinct training keys (every key is then
  counted); above that, the expected share under uniform hashing, ``1 - (1 - 1/(n-1))^(D-1)``,
  with the distinct count ``D`` estimated from the :class:`KeySketch` (relative error about
  ``1/sqrt(SKETCH_KEYS)`` = 0.4%); ``exact`` says which. The suggested size for ``p`` is the
  smallest ``n`` whose expected share of values with a row of their own is at least ``p``
  (about ``D / -ln p`` rows: 19.5 D for 95%, 99.5 D for 99%).

A table is warned about when its ``outside_share`` is above 1% or its ``collided_share`` above
50% (:data:`WARN_ABOVE`).
"""

from __future__ import annotations

import math

import numpy as np

from recsys_dist.data.mapping import merge_counts

# Warn about a table that loses more than this share of its training values. Under hash, 1% would
# need about 100 rows per distinct value, so nearly every hash table would warn on every run: the
# warning is kept for tables too small for their values (more than half share a row: fewer than
# about 1.44 rows per distinct value); the numbers are recorded for every table either way.
WARN_ABOVE = {"vocabulary": 0.01, "hash": 0.5}
TARGETS = (95, 99)  # suggested sizes: for these percent of the training values on rows of their own
SKETCH_KEYS = 1 << 16  # a hash feature's keys counted one by one (exact up to this many distinct)
_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(keys: np.ndarray) -> np.ndarray:
    """uint64 [N] -> uint64 [N], SplitMix64's finalizer: a bijection that spreads any keys (Criteo's
    raw 32-bit ones too) uniformly over 64 bits."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


class KeySketch:
    """One hash-mapped feature's training values: how many (``total``), and the ``k`` distinct keys
    of smallest :func:`mix64` with their exact counts (a K-minimum-values sketch): every distinct
    key while there are at most ``k``, a uniform sample of them beyond. Memory: 24 bytes per kept
    key (``k`` = 65,536: 1.5 MB), plus the keys of one block pending a merge.

    A kept key's count is exact: the threshold (the largest kept hash) only falls, so a key kept
    at the end was never dropped. Sketches of disjoint rows merge (:meth:`merge`) as one would be."""

    def __init__(self, k: int = SKETCH_KEYS) -> None:
        self.k, self.total, self.overflowed = k, 0, False
        self.keys = np.zeros(0, np.uint64)
        self.counts = np.zeros(0, np.int64)
        self.threshold = np.uint64(2**64 - 1)  # keys hashing above it are never kept
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_len = 0

    def add(self, keys: np.ndarray) -> None:
        """Count the uint64 ``keys`` [N] (one per training value)."""
        self.total += len(keys)
        if self.overflowed:
            keys = keys[mix64(keys) <= self.threshold]
        if len(keys):
            u, c = np.unique(keys, return_counts=True)
            self._add(u, c)

    def _add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self._pending.append((keys, counts))
        self._pending_len += len(keys)
        if self._pending_len > self.k:
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        self.keys, self.counts = merge_counts([(self.keys, self.counts), *self._pending])
        self._pending, self._pending_len = [], 0
        if len(self.keys) > self.k:
            h = mix64(self.keys)
            keep = np.sort(np.argpartition(h, self.k - 1)[: self.k])
            self.keys, self.counts = self.keys[keep], self.counts[keep]
            self.overflowed = True
        if self.overflowed:
            self.threshold = mix64(self.keys).max()

    def merge(self, other: KeySketch) -> None:
        """Add the counts of ``other``, a sketch of other rows."""
        other._merge()
        self.total += other.total
        self.overflowed |= other.overflowed
        if other.overflowed:
            self.threshold = min(self.threshold, other.threshold)
        self._add(other.keys, other.counts)
        self._merge()

    def distinct(self) -> tuple[int, bool]:
        """(distinct keys counted, exact): the count itself up to ``k``, else the KMV estimate
        ``(k - 1) / u_k`` (``u_k`` the largest kept hash as a fraction of 2^64)."""
        self._merge()
        if not self.overflowed:
            return len(self.keys), True
        return int(round((self.k - 1) / ((float(self.threshold) + 1.0) / 2.0**64))), False


def _share(part: int, total: int) -> float | None:
    return part / total if total else None


def vocabulary_coverage(counts: np.ndarray, kept_counts: np.ndarray, min_count: int) -> dict:
    """One vocabulary-mapped feature's coverage (see the module docstring).

    Args:
        counts: int64 [D] training count of every distinct key (the counting pass's).
        kept_counts: int64 [V] counts of the keys the vocabulary kept.
        min_count: ``data.min_count``.
    """
    total = int(counts.sum())
    rare = int(counts[counts < min_count].sum())
    outside = total - int(kept_counts.sum())
    eligible = np.sort(counts[counts >= min_count])[::-1]
    cum = np.cumsum(eligible)
    suggested = {}
    for p in TARGETS:
        need = -(-p * total // 100)  # ceil(p% of the values), in integers
        i = int(np.searchsorted(cum, need))  # the first i with cum[i] >= need: keys 0..i hold enough
        suggested[f"{p}%"] = 2 if need == 0 else (2 + i + 1 if i < len(cum) else None)
    return {
        "table_rows": 2 + len(kept_counts),
        "train_values": total,
        "distinct": len(counts),
        "outside_share": _share(outside, total),
        "cut_by_size": _share(outside - rare, total),
        "below_min_count": _share(rare, total),
        "suggested_num_embeddings": suggested,
    }


def expected_collided_share(distinct: int, rows: int) -> float:
    """Expected share of values whose row also receives another of ``distinct`` keys, hashed
    uniformly onto ``rows - 1`` rows: ``1 - (1 - 1/(rows-1))^(distinct-1)``."""
    m = rows - 1
    if distinct <= 1 or m <= 0:
        return 0.0 if distinct <= 1 else 1.0
    return -math.expm1((distinct - 1) * math.log1p(-1 / m)) if m > 1 else 1.0


def hash_size_for(distinct: int, p: int) -> int:
    """The smallest table size ``n`` whose expected share of values with a row of their own
    (:func:`expected_collided_share`) is at least ``p`` percent."""
    if distinct <= 1:
        return 2
    # (1 - 1/m)^(D-1) >= p  <=>  m >= 1 / (1 - p^(1/(D-1)))
    m = max(1, math.ceil(1 / -math.expm1(math.log(p / 100) / (distinct - 1))))  # rows besides row 0
    while 1 - expected_collided_share(distinct, m + 1) < p / 100:  # float rounding at the edge
        m += 1
    while m > 1 and 1 - expected_collided_share(distinct, m) >= p / 100:
        m -= 1
    return m + 1


def hash_coverage(sketch: KeySketch, rows: int, exact_rows: bool = True) -> dict:
    """One hash-mapped feature's coverage in a table of ``rows`` rows (see the module docstring);
    ``exact_rows``: False when the counted rows are not exactly the training split's."""
    distinct, exact = sketch.distinct()
    total = sketch.total
    if exact:
        buckets = 1 + sketch.keys % np.uint64(rows - 1)
        _, inverse, per_row = np.unique(buckets, return_inverse=True, return_counts=True)
        collided = int(sketch.counts[per_row[inverse] > 1].sum())
        share = _share(collided, total)
    else:
        share = expected_collided_share(distinct, rows) if total else None
    return {
        "table_rows": rows,
        "train_values": total,
        "distinct": distinct,
        "exact": exact and exact_rows,
        "collided_share": share,
        "suggested_num_embeddings": {f"{p}%": hash_size_for(distinct, p) for p in TARGETS},
    }


# ------------------------------------------------------------------------------- reporting


def lost_share(table: dict) -> float | None:
    """A table's share of training values without a row of their own (either mapping)."""
    return table.get("outside_share", table.get("collided_share"))


def above(kind: str, table: dict) -> bool:
    """Whether ``table`` loses more than :data:`WARN_ABOVE` of its training values."""
    return (lost_share(table) or 0) > WARN_ABOVE["hash" if kind == "hash" else "vocabulary"]


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"


def _num(n) -> str:
    return "?" if n is None else f"{n:,}"


def _sizes(table: dict, min_count: int | None) -> str:
    s = table.get("suggested_num_embeddings")
    if not s:
        return "sizes to suggest not counted"
    if "collided_share" in table:
        return "a row of their own for " + ", ".join(f"{p} at about {n:,} rows" for p, n in s.items())
    return "in vocabulary: " + ", ".join(
        f"{p} at {n:,} rows" if n is not None else f"{p} at no size with min_count {min_count}" for p, n in s.items()
    )


def describe_table(name: str, t: dict, min_count: int | None = None) -> str:
    """One table's part of the coverage warning."""
    if "collided_share" in t:
        about = "" if t.get("exact") else "about "
        return (
            f"{name} {_pct(t['collided_share'])} ({about}{_num(t['distinct'])} distinct values hashed onto "
            f"{t['table_rows'] - 1:,} table row{'s' if t['table_rows'] != 2 else ''}; {_sizes(t, min_count)})"
        )
    why = []
    if t.get("cut_by_size"):
        why.append(f"{_pct(t['cut_by_size'])} left out by num_embeddings")
    if t.get("below_min_count"):
        why.append(f"{_pct(t['below_min_count'])} seen fewer than min_count {min_count} times")
    return (
        f"{name} {_pct(t['outside_share'])} ({'; '.join(why) + '; ' if why else ''}"
        f"{t['table_rows'] - 2:,} of {_num(t.get('distinct'))} distinct values kept; {_sizes(t, min_count)})"
    )


def coverage_warning(raw, kind: str, tables: dict, min_count: int | None = None, listed: int = 5) -> str | None:
    """The warning about the tables of ``tables`` (name -> coverage) above :data:`WARN_ABOVE`,
    worst first, at most ``listed`` named; None when no table is."""
    high = sorted(((n, t) for n, t in tables.items() if above(kind, t)), key=lambda nt: -lost_share(nt[1]))
    if not high:
        return None
    shown = "; ".join(describe_table(n, t, min_count) for n, t in high[:listed])
    more = f"; and {len(high) - listed} more" if len(high) > listed else ""
    where = "per table: categorical_mapping.coverage in manifest.json, or recsys-dist plan"
    if kind == "hash":
        return (
            f"{raw}: in {len(high)} of {len(tables)} tables, more than {WARN_ABOVE['hash']:.0%} of the training "
            f"values share their hashed row with another value, so the model cannot tell them apart: {shown}{more}. "
            f"Raise data.num_embeddings for them (a list gives each table its size) or use "
            f"data.categorical_mapping: vocabulary ({where})"
        )
    return (
        f"{raw}: in {len(high)} of {len(tables)} tables, more than {WARN_ABOVE['vocabulary']:.0%} of the training "
        f"values are out of vocabulary and share its row 1, so the model cannot tell them apart: {shown}{more}. "
        f"Raise data.num_embeddings to the size suggested (a list gives each table its size) or lower "
        f"data.min_count ({where})"
    )


def coverage_lines(kind: str, tables: dict) -> list[str]:
    """``tables`` (name -> coverage) as a text table: rows, training values, distinct values, the
    share without a row of their own (``!``: above :data:`WARN_ABOVE`), and the sizes suggested
    for 95% / 99% (``~``: expected, hash)."""
    lost = "share a row" if kind == "hash" else "out of vocab"
    head = ["table", "rows", "train values", "distinct", lost] + [f"rows for {p}%" for p in TARGETS]
    about = "~" if kind == "hash" else ""
    body = []
    for name, t in tables.items():
        suggested = t.get("suggested_num_embeddings")
        body.append(
            [
                name,
                _num(t.get("table_rows")),
                _num(t.get("train_values")),
                ("" if t.get("exact", True) else "~") + _num(t.get("distinct")),
                _pct(lost_share(t)) + (" !" if above(kind, t) else ""),
            ]
            + [about + _num(suggested.get(f"{p}%")) if suggested else "?" for p in TARGETS]
        )
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [head, *body]
    ]
