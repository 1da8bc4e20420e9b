"""Categorical value -> table row: hash-modulo (stateless) or a training-split vocabulary.

Every format first turns a categorical value into a 64-bit key: Criteo's 8 hex digits are
the key itself (a uint32; so are the values of a ``data.schema.hex_categorical`` column), any
other value is BLAKE2b with an 8-byte digest (``hashlib.blake2b(text, digest_size=8)``, not
the first 8 bytes of the 64-byte BLAKE2b, which differ) of its UTF-8 text, read as a
little-endian uint64. Then, for a table of ``n`` rows:

- ``hash``: id = ``1 + key mod (n - 1)``;
- ``vocabulary``: id = ``2 + rank`` of the key among the training split's keys seen at
  least ``min_count`` times (rank by count, descending, then key), keeping at most ``n - 2``;
  every other key is out of vocabulary, id ``OOV_ID`` = 1.

- ``managed``: id = ``1 + key mod (2^63 - 2)``, the key itself in TorchRec's int64 id space
  (``2^63 - 1`` is its managed-collision module's empty-slot marker); never reduced to the
  table size: the managed-collision module maps it to a row while training.

A missing value (empty field) is id ``MISSING_ID`` = 0 in all three. Ids therefore always lie in
``[0, table size)``. Keys of text values can collide (64 bits: about 3e-6 for 10 million
distinct values of one feature), which only merges two values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

MISSING_ID = 0
OOV_ID = 1


@dataclass
class SparseKeys:
    """One feature's keys for N rows.

    Attributes:
        keys: uint64; [N] one-hot, or [sum(lengths)] multi-hot.
        present: bool [N] (one-hot; False = missing) or None (multi-hot: every key present).
        lengths: int32 [N] keys per row for multi-hot, None for one-hot.
    """

    keys: np.ndarray
    present: np.ndarray | None = None
    lengths: np.ndarray | None = None


def text_keys(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Strings -> (uint64 BLAKE2b-64 keys [N], present [N]); "" and null are not present.

    Hashing runs once per distinct value of ``col`` (``dictionary_encode``), not per row.
    """
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = pc.dictionary_encode(pc.fill_null(col, ""))
    uniques = enc.dictionary.to_pylist()
    h = np.fromiter(
        (int.from_bytes(hashlib.blake2b(u.encode(), digest_size=8).digest(), "little") for u in uniques),
        dtype=np.uint64,
        count=len(uniques),
    )
    empty = np.array([u == "" for u in uniques], dtype=bool)
    idx = enc.indices.to_numpy(zero_copy_only=False)
    return h[idx], ~empty[idx]


def hash_ids(keys: np.ndarray, num_embeddings: int) -> np.ndarray:
    """uint64 keys -> int64 ids ``1 + key mod (num_embeddings - 1)`` (never 0)."""
    return (1 + keys % np.uint64(num_embeddings - 1)).astype(np.int64)


MANAGED_ID_SPACE = 2**63 - 1  # managed ids lie in [0, MANAGED_ID_SPACE)
# The "table size" recorded for a raw-valued feature (FeatureSpec.value_names), which has no
# table: the smallest valid size, so the per-feature size lists stay one entry per feature.
NO_TABLE_ROWS = 2


def managed_ids(keys: np.ndarray) -> np.ndarray:
    """uint64 keys -> int64 raw ids ``1 + key mod (2^63 - 2)`` in ``[1, 2^63 - 1)`` (never 0)."""
    return (1 + keys % np.uint64(MANAGED_ID_SPACE - 1)).astype(np.int64)


def to_arrow(ids: np.ndarray, sk: SparseKeys) -> pa.Array:
    """Ids of ``sk.keys`` -> int64 column (one-hot, missing = 0) or list<int64> (multi-hot)."""
    if sk.lengths is None:
        ids = ids.copy()
        ids[~sk.present] = MISSING_ID
        return pa.array(ids, pa.int64())
    offsets = np.concatenate([[0], np.cumsum(sk.lengths, dtype=np.int64)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, pa.int64()))


class Vocabulary:
    """One feature's vocabulary: sorted keys and their ids (2 .. size - 1).

    Args:
        keys: uint64 [V] distinct keys, any order.
        ids: int64 [V] their ids.
        counts: int64 [V] training-split counts (kept for the manifest and the saved file).
    """

    def __init__(self, keys: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        order = np.argsort(keys, kind="stable")
        self.keys, self.ids, self.counts = keys[order], ids[order], counts[order]
        # Set by VocabularyCounter.build: the training keys left out (sorted) with their counts,
        # and min_count, to tell why a value is out of vocabulary (oov_causes). Not saved.
        self.dropped: tuple[np.ndarray, np.ndarray] | None = None
        self.min_count = 1

    @classmethod
    def empty(cls) -> Vocabulary:
        """No keys: every value is out of vocabulary (size 2)."""
        return cls(np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64))

    @property
    def size(self) -> int:
        """Table rows: missing + OOV + one per kept key."""
        return 2 + len(self.keys)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """uint64 keys -> int64 ids; a key not in the vocabulary -> ``OOV_ID``."""
        if not len(self.keys):
            return np.full(len(keys), OOV_ID, np.int64)
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return np.where(self.keys[pos] == keys, self.ids[pos], OOV_ID).astype(np.int64)

    def oov_causes(self, keys: np.ndarray) -> tuple[int, int]:
        """Of out-of-vocabulary ``keys`` (uint64 [N]), how many were seen in the training split
        (``min_count`` times or more: left out by the size cap; fewer: by ``min_count``); the
        rest were never seen there. (0, 0) without :attr:`dropped` (a loaded vocabulary)."""
        if self.dropped is None or not len(keys) or not len(self.dropped[0]):
            return 0, 0
        dk, dc = self.dropped
        pos = np.minimum(np.searchsorted(dk, keys), len(dk) - 1)
        count = np.where(dk[pos] == keys, dc[pos], 0)
        return int(np.count_nonzero(count >= self.min_count)), int(
            np.count_nonzero((count > 0) & (count < self.min_count))
        )


def merge_counts(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(keys uint64 [n_i], counts int64 [n_i]) pairs -> (distinct keys, sorted, uint64 [D], their
    summed counts, int64 [D]). Shared by :class:`VocabularyCounter` and ``coverage.KeySketch``."""
    keys, inverse = np.unique(np.concatenate([k for k, _ in parts]), return_inverse=True)
    counts = np.bincount(inverse, weights=np.concatenate([c for _, c in parts]), minlength=len(keys))
    return keys, counts.astype(np.int64)


class VocabularyCounter:
    """Counts keys of one feature over the training rows, in memory bounded by the number
    of distinct keys: 16 bytes (key, count) each, plus at most as much again pending a merge.
    The vocabulary it builds holds the keys it leaves out with their counts (16 bytes each,
    while the conversion writes: see :meth:`Vocabulary.oov_causes`)."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.uint64)
        self.counts = np.zeros(0, np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_len = 0

    def add(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        u, c = np.unique(keys, return_counts=True)
        self._pending.append((u, c))
        self._pending_len += len(u)
        if self._pending_len > max(len(self.keys), 1 << 20):  # merge rarely: amortised linear
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        self.keys, self.counts = merge_counts([(self.keys, self.counts), *self._pending])
        self._pending, self._pending_len = [], 0

    def distinct(self) -> int:
        self._merge()
        return len(self.keys)

    def build(self, min_count: int, max_size: int) -> Vocabulary:
        """Keys seen at least ``min_count`` times, the most frequent first, at most
        ``max_size - 2`` of them (ids 0 and 1 are missing and OOV)."""
        self._merge()
        keep = self.counts >= min_count
        keys, counts = self.keys[keep], self.counts[keep]
        order = np.lexsort((keys, -counts))[: max(max_size - 2, 0)]
        vocab = Vocabulary(keys[order], np.arange(2, 2 + len(order), dtype=np.int64), counts[order])
        left_out = np.ones(len(self.keys), bool)  # self.keys are sorted (np.unique)
        left_out[np.flatnonzero(keep)[order]] = False
        vocab.dropped, vocab.min_count = (self.keys[left_out], self.counts[left_out]), min_count
        return vocab


def save_vocabularies(path: Path, names: list[str], vocabs: list[Vocabulary]) -> None:
    """One Parquet file: ``feature`` (string), ``key`` (uint64), ``id`` (int64), ``count`` (int64)."""
    table = pa.table(
        {
            "feature": pa.array([n for n, v in zip(names, vocabs) for _ in range(len(v.keys))], pa.string()),
            "key": pa.array(np.concatenate([v.keys for v in vocabs]) if vocabs else [], pa.uint64()),
            "id": pa.array(np.concatenate([v.ids for v in vocabs]) if vocabs else [], pa.int64()),
            "count": pa.array(np.concatenate([v.counts for v in vocabs]) if vocabs else [], pa.int64()),
        }
    )
    pq.write_table(table, path)


def load_vocabularies(path: Path, names: list[str]) -> list[Vocabulary]:
    """The vocabularies of ``names`` from a file written by :func:`save_vocabularies` (a
    feature with no rows there has an empty vocabulary: every value is out of vocabulary)."""
    t = pq.read_table(path)
    feature = t.column("feature").to_numpy(zero_copy_only=False)
    keys, ids, counts = (t.column(c).to_numpy() for c in ("key", "id", "count"))
    return [Vocabulary(keys[feature == n], ids[feature == n], counts[feature == n]) for n in names]
