"""The reading passes of a conversion: raw rows with their split (:class:`Reader`), a block's
transform into output columns (:class:`Transform`), what a pass adds up (:class:`Totals`),
the conversion pass (:func:`convert_rows`) and the vocabulary-counting pass."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_dist.data import mapping as mp
from recsys_dist.data.coverage import KeySketch
from recsys_dist.data.formats.ids import IdText, id_columns
from recsys_dist.data.prefetch import prefetched
from recsys_dist.data.splits import (
    SPLITS,
    LastEvents,
    Split,
    last_events_assign,
    position_assign,
    random_assign,
    time_assign,
)
from recsys_dist.data.text import LINE_COLUMN
from recsys_dist.errors import DataError

# Separators a multi-hot text column may use instead of the configured one (see _separator_warnings).
SEPARATOR_CANDIDATES = (",", ";", "|", " ", "/")


class Reader:
    """Record batches of one raw file, bad rows left out under ``skip``, with their split.

    ``cap`` bounds the raw rows read. A batch comes with the index of its first row among
    the rows kept so far (position, random and leave_last_out splits go by that index).
    ``last_rows``: under ``leave_last_out``, the (validation, test) row indices of
    :func:`last_event_rows`.
    """

    def __init__(
        self,
        fmt,
        path: str,
        split: Split,
        fixed: int | None,
        cap: int | None,
        bounds: np.ndarray | None,
        skipped: list | None,
        last_rows: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.fmt, self.path, self.split, self.fixed, self.cap = fmt, path, split, fixed, cap
        self.bounds, self.skipped, self.last_rows = bounds, skipped, last_rows
        self.n_bad_values = 0  # rows left out for a rejected value
        self.n_examples = 0  # of them, entries added to ``skipped`` (the rest of it are whole bad lines)

    def batches(self) -> Iterator[tuple[pa.RecordBatch, int]]:
        read = kept = 0
        # The next block is read and parsed (all cores) while this one is transformed (one core).
        chunks = self.fmt.read_chunks(self.path, self.skipped, max_rows=self.cap)
        for _, table in prefetched(chunks, 1, "recsys_dist-convert-read"):
            for batch in table.combine_chunks().to_batches():
                if self.cap is not None:
                    if read >= self.cap:
                        return
                    batch = batch.slice(0, self.cap - read)
                read += batch.num_rows
                if self.skipped is not None:
                    bad, reasons = self.fmt.bad_row_mask(batch)
                    if bad.any():
                        line_col = batch.column(LINE_COLUMN) if LINE_COLUMN in batch.schema.names else None
                        for i, why in zip(np.flatnonzero(bad)[:20], reasons[:20]):
                            line = None if line_col is None else line_col[int(i)].as_py()
                            self.skipped.append(
                                (line, why) if line is not None else (None, f"row {kept + int(i) + 1}: {why}")
                            )
                            self.n_examples += 1
                        self.n_bad_values += int(bad.sum())
                        batch = batch.filter(pa.array(~bad))
                if batch.num_rows:
                    yield batch, kept
                kept += batch.num_rows
            # pyarrow's allocator keeps freed blocks; hand them back so RSS tracks one block.
            pa.default_memory_pool().release_unused()

    def assign(self, batch: pa.RecordBatch, first: int) -> np.ndarray:
        """int8 [N]: the split of each row (0 train, 1 validation, 2 test)."""
        n, s = batch.num_rows, self.split
        if self.fixed is not None:
            return np.full(n, self.fixed, np.int8)
        if s.by == "position":
            return position_assign(self.bounds, first, n)
        if s.by == "random":
            return random_assign(s.seed, s.fractions, first, n)
        if s.by == "leave_last_out":
            return last_events_assign(*self.last_rows, first, n)
        return time_assign(self.numbers(batch, first, s.column), s.thresholds)

    def column(self, batch: pa.RecordBatch, name: str, key: str) -> pa.Array:
        """The raw column ``name`` of ``batch`` (config key ``key`` names it).

        Raises:
            DataError: not a column of the file (naming the key and the file's columns)."""
        if name not in batch.schema.names:
            raise DataError(
                f"{self.path}: {key} {name!r} is not a column of {self.fmt.name} (columns: {batch.schema.names})"
            )
        return batch.column(name)

    def numbers(self, batch: pa.RecordBatch, first: int, name: str) -> np.ndarray:
        """float64 [N]: the numeric split column ``name`` of ``batch``.

        Raises:
            DataError: the column is missing, or a value is empty or not a number (row named)."""
        col = self.column(batch, name, "data.split.column")
        why = f"split.by {self.split.by} needs a number on every row"
        try:
            values = pc.cast(
                pc.utf8_trim_whitespace(col) if pa.types.is_string(col.type) else col, pa.float64()
            ).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:
            bad = [i for i, v in enumerate(col.to_pylist()) if not _is_number(v)][0]
            raise DataError(
                f"{self.path}, data row {first + bad + 1}, column {name}: '{col[bad].as_py()}' is not a number ({why})"
            ) from None
        if np.isnan(values).any():
            bad = int(np.flatnonzero(np.isnan(values))[0])
            raise DataError(f"{self.path}, data row {first + bad + 1}, column {name}: empty ({why})")
        return values


def last_event_rows(reader: Reader) -> tuple[np.ndarray, np.ndarray]:
    """Under ``split.by: leave_last_out``: (validation, test) row indices (sorted int64, among
    the rows ``reader`` keeps) from one pass over the split's user and time columns
    (``recsys_dist.data.splits.LastEvents``; a user is its column's trimmed text, as
    ``data.schema.history`` keys it).

    Raises:
        DataError: the user or time column is missing, or a time is empty or not a number."""
    found = LastEvents()
    for batch, first in reader.batches():
        times = reader.numbers(batch, first, reader.split.column)
        col = reader.column(batch, reader.split.user, "data.split.user")
        users, _ = mp.text_keys(pc.utf8_trim_whitespace(pc.fill_null(pc.cast(col, pa.string()), "")))
        found.add(users, times, first)
    return found.rows()


def _is_number(v) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


class Transform:
    """One block of text columns -> (output record batch, missing count per dense column).

    ``coverage``: the conversion pass counts each hash-mapped feature's training keys
    (:class:`Totals`, ``recsys_dist.data.coverage``)."""

    def __init__(
        self, fmt, sizes: list[int], vocabs, schema: pa.Schema, managed: list[bool], coverage: bool = False
    ) -> None:
        self.fmt, self.sizes, self.vocabs, self.schema = fmt, sizes, vocabs, schema
        self.managed = managed  # per feature: raw 63-bit keys for a managed-collision module, no reduction
        self.coverage = coverage

    def __call__(self, batch: pa.RecordBatch, path: str, first: int) -> tuple[pa.RecordBatch, np.ndarray]:
        return self.apply(batch, path, first)[:2]

    def apply(self, batch: pa.RecordBatch, path: str, first: int) -> tuple:
        """(output batch, missing count per dense column, the keys per feature (``SparseKeys``),
        the ids of those keys per feature (int64, before missing values become 0))."""
        missing = np.zeros(len(self.fmt.dense_names))
        for j, n in enumerate(self.fmt.dense_names):
            col = batch.column(n)
            missing[j] = (
                (pc.sum(pc.equal(pc.fill_null(col, ""), "")).as_py() or 0)
                if pa.types.is_string(col.type)
                else col.null_count
            )
        try:
            labels, dense, sparse = self.fmt.parse_batch(batch, path, first + 1)
        except DataError as err:
            raise self._first_bad_row(batch, path, first) or err from None
        ids, raw_ids = [], []
        for j, sk in enumerate(sparse):
            if self.managed[j]:
                got = mp.managed_ids(sk.keys)
            elif self.vocabs is not None:
                got = self.vocabs[j].lookup(sk.keys)
            else:
                got = mp.hash_ids(sk.keys, self.sizes[j])
            ids.append(mp.to_arrow(got, sk))
            raw_ids.append(got)
        label_cols = [labels] if labels.ndim == 1 else list(labels.T)
        weights = []
        if self.fmt.weight_column:
            weights = [pa.array(self.fmt.weights(batch, path, first + 1), pa.float32())]
        out = pa.RecordBatch.from_arrays(
            [pa.array(y, pa.float32()) for y in label_cols]
            + [pa.array(d, pa.float32()) for d in dense]
            + ids
            + weights,
            schema=self.schema,
        )
        return out, missing, sparse, raw_ids

    def _first_bad_row(self, batch: pa.RecordBatch, path: str, first: int) -> DataError | None:
        """The error of the batch's first row with a rejected value: ``parse_batch`` checks
        column by column, so the error it raised may name a later row (in another column)."""
        bad, _ = self.fmt.bad_row_mask(batch)
        if not bad.any():
            return None
        i = int(np.flatnonzero(bad)[0])
        try:
            self.fmt.parse_batch(batch.slice(i, 1), path, first + i + 1)
        except DataError as err:
            return err
        return None


class Totals:
    """What a conversion pass adds up besides the rows it writes: the training split's dense
    statistics (count, sum, sum of squares of the transformed values) and label counts, the
    missing count per dense column over all rows, the rows kept (``seen``), under vocabulary
    mapping the present and out-of-vocabulary ids per split and feature (``ids``) and of the
    out-of-vocabulary ones those the counting pass saw (``causes``), per hash-mapped feature a
    sketch of its training keys (``sketches``, under ``Transform.coverage``), and per multi-hot
    text column how many values contain each separator candidate (``separators``)."""

    def __init__(self, num_dense: int, num_sparse: int = 0, multi_hot: list | tuple = ()) -> None:
        self.stats, self.missing = np.zeros((3, num_dense)), np.zeros(num_dense)
        self.labels = np.zeros(2)  # training rows, and of them label 1 (the first task's label)
        self.num_labels = 1
        self.seen, self.n_skipped, self.examples = 0, 0, []
        self.ids = np.zeros((3, 2, num_sparse))  # split, (present ids, OOV ids), feature
        # split, (OOV values seen >= min_count times in training: cut by the size cap, seen fewer), feature
        self.causes = np.zeros((3, 2, num_sparse))
        self.sketches: list[KeySketch | None] = []
        self.recut = False  # the splits were cut again after the keys were counted (position split, rows skipped)
        self.multi_hot = list(multi_hot)  # (column, configured separator)
        # per column: {"values": non-empty values, separator: values containing it}, an example each
        self.separators: list[dict] = [{} for _ in self.multi_hot]
        self.separator_examples: list[dict] = [{} for _ in self.multi_hot]
        self.id_text: IdText | None = None  # the raw file's columns, and its id columns of integers only

    @classmethod
    def of(cls, transform: Transform) -> Totals:
        fmt = transform.fmt
        spec = fmt.spec
        multi_hot = [(n, spec.separator) for n in spec.multi_hot] if spec is not None else []
        out = cls(len(fmt.dense_names), len(fmt.sparse_names) if transform.vocabs is not None else 0, multi_hot)
        out.num_labels = len(fmt.label_columns)  # dense columns follow the labels
        if transform.coverage and transform.vocabs is None:
            out.sketches = [None if m else KeySketch() for m in transform.managed]
        out.id_text = IdText(id_columns(fmt.name, spec))
        return out

    def add_keys(self, k: int, mask: np.ndarray, sparse: list, ids: list, vocabs) -> None:
        """Count the keys of the rows of split ``k`` (``mask``, bool [N] over the block's rows):
        training keys into the sketches; out-of-vocabulary ones by cause (``vocabs``)."""
        for j, sk in enumerate(sparse):
            sketch = self.sketches[j] if k == 0 and self.sketches else None
            vocab = vocabs[j] if vocabs is not None and vocabs[j].dropped is not None else None
            if sketch is None and vocab is None:
                continue
            rows = mask if sk.lengths is None else np.repeat(mask, sk.lengths)
            values = rows & sk.present if sk.lengths is None else rows
            if sketch is not None:
                sketch.add(sk.keys[values])
            else:
                self.causes[k, :, j] += vocab.oov_causes(sk.keys[values & (ids[j] == mp.OOV_ID)])

    def add_train(self, part: pa.RecordBatch) -> None:
        """Count rows of the training split (label, then the dense columns, as written)."""
        y = part.column(0).to_numpy()
        self.labels += [len(y), y.sum()]
        k = len(self.missing)
        if k:
            d = np.stack([part.column(self.num_labels + j).to_numpy() for j in range(k)], axis=1).astype(np.float64)
            self.stats += [np.full(k, len(d)), d.sum(0), (d**2).sum(0)]

    def add_part(self, k: int, part: pa.RecordBatch) -> None:
        """Count rows of split ``k`` as written (the training statistics, and the ids)."""
        if k == 0:
            self.add_train(part)
        first = self.num_labels + len(self.missing)
        for j in range(self.ids.shape[2]):
            col = part.column(first + j)
            if pa.types.is_list(col.type):
                col = pc.list_flatten(col)
            ids = col.to_numpy(zero_copy_only=False)
            self.ids[k, 0, j] += np.count_nonzero(ids != mp.MISSING_ID)
            self.ids[k, 1, j] += np.count_nonzero(ids == mp.OOV_ID)

    def add_raw(self, batch: pa.RecordBatch) -> None:
        """Count the separators in the raw multi-hot text columns of ``batch``; note its columns
        and which id columns hold only integers (``id_text``)."""
        if self.id_text is not None:
            self.id_text.add(batch)
        for j, (name, sep) in enumerate(self.multi_hot):
            col = batch.column(name)
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                continue  # a Parquet list column: no separator
            text = pc.utf8_trim_whitespace(pc.fill_null(col, ""))
            counts, examples = self.separators[j], self.separator_examples[j]
            counts["values"] = counts.get("values", 0) + (pc.sum(pc.not_equal(text, "")).as_py() or 0)
            for c in dict.fromkeys((sep, *SEPARATOR_CANDIDATES)):
                has = pc.match_substring(text, c)
                n = pc.sum(has).as_py() or 0
                counts[c] = counts.get(c, 0) + n
                if n and c not in examples:
                    examples[c] = text.filter(has)[0].as_py()

    def add(self, other: Totals) -> None:
        self.stats += other.stats
        self.missing += other.missing
        self.labels += other.labels
        self.seen += other.seen
        self.n_skipped += other.n_skipped
        self.examples = (self.examples + other.examples)[:20]
        self.ids += other.ids
        self.causes += other.causes
        for mine, theirs in zip(self.sketches, other.sketches):
            if mine is not None:
                mine.merge(theirs)
        if self.id_text is not None and other.id_text is not None:
            self.id_text.merge(other.id_text)
        for mine, theirs in zip(self.separators, other.separators):
            for c, n in theirs.items():
                mine[c] = mine.get(c, 0) + n
        for mine, theirs in zip(self.separator_examples, other.separator_examples):
            for c, v in theirs.items():
                mine.setdefault(c, v)


def convert_rows(readers: list[Reader], writers: dict, transform: Transform, bar=None) -> Totals:
    """Rows of ``readers`` to the split writers they belong to (``writers[split]``)."""
    t = Totals.of(transform)
    for reader in readers:
        for batch, first in reader.batches():
            where = reader.assign(batch, first)
            out_batch, block_missing, sparse, ids = transform.apply(batch, reader.path, first)
            t.add_raw(batch)
            if bar is not None:
                bar.update(min(batch.nbytes, max(bar.total - bar.n, 0)))
            t.missing += block_missing
            for k, s in enumerate(SPLITS):
                mask = where == k
                if mask.all():
                    part = out_batch
                elif mask.any():
                    part = out_batch.filter(pa.array(mask))
                else:
                    continue
                writers[s].add(part)
                t.add_part(k, part)
                t.add_keys(k, mask, sparse, ids, transform.vocabs)
            t.seen += batch.num_rows
    return t


def position_bounds(fractions, total: int) -> np.ndarray:
    """Row bounds [0, train end, validation end, total] of a position split of ``total`` rows."""
    bounds = np.floor(np.cumsum([0.0, *fractions]) * total + 1e-9).astype(int)
    bounds[-1] = total
    return bounds


def first_bad_row(readers: list[Reader], transform: Transform) -> str | None:
    """The error the first bad row gives under ``on_bad_row: error`` (file, line, column and
    why), read again without skipping; for the message when every row was skipped."""
    for r in readers:
        strict = Reader(r.fmt, r.path, r.split, r.fixed, r.cap, r.bounds, None)
        try:
            for batch, first in strict.batches():
                transform(batch, strict.path, first)
        except DataError as err:
            return str(err)
    return None


def in_line_order(skipped: list) -> list:
    """``skipped`` ((line or None, reason) pairs, recorded by kind and block as they were found)
    sorted by file line, those without a line last: its first entry is the first bad line."""
    return sorted(skipped, key=lambda s: (s[0] is None, s[0] or 0))


def rows_skipped(skipped: list, readers: list[Reader]) -> int:
    """Rows left out: ``skipped`` holds every bad line and up to 20 examples of rejected values
    per block, so the values are counted by the readers instead."""
    return len(skipped) - sum(r.n_examples for r in readers) + sum(r.n_bad_values for r in readers)


def _train_keys(sk: mp.SparseKeys, train: np.ndarray) -> np.ndarray:
    if sk.lengths is None:
        return sk.keys[train & sk.present]
    return sk.keys[np.repeat(train, sk.lengths)]


def count_vocabularies(fmt, readers: list[Reader], bar, managed: list[bool]) -> list[mp.VocabularyCounter | None]:
    """Pass 1: count each feature's keys over the training rows; None for a managed feature
    (``managed``: it takes raw keys, and a vocabulary of them would go unused)."""
    counters = [None if m else mp.VocabularyCounter() for m in managed]
    for reader, batch, first in ((r, b, f) for r in readers for b, f in r.batches()):
        bar.update(batch.nbytes)
        train = reader.assign(batch, first) == 0
        if reader.split.by == "position" and first >= reader.bounds[1]:
            break  # the training rows are a prefix
        if not train.any():
            continue
        _, _, sparse = fmt.parse_batch(batch, reader.path, first + 1)
        for c, sk in zip(counters, sparse):
            if c is not None:
                c.add(_train_keys(sk, train))
    return counters
