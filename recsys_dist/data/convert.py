"""Raw file(s) -> train / validation / test Parquet, streamed in bounded memory, cached.

Format-independent: a format object (``criteo.CRITEO``, ``avazu.AVAZU``,
``schema.SchemaFormat``) reads blocks of text columns, finds bad rows and parses a block into
labels, dense columns and categorical keys; this module assigns rows to splits
(``splits.Split``), maps keys to ids (``mapping``: hash, or a vocabulary counted over the
training rows in a first pass), writes full-size row groups and writes the manifest last.

A cache entry (one directory per raw file and conversion settings) is converted by one process
at a time: an exclusive ``fcntl.flock`` on ``<entry>.lock`` beside the entry's directory is
held while the entry is checked, converted or rebuilt, so a second process converting the same
data waits and then reuses the result. Every file is written under a name of its own process
and renamed into place; ``manifest.json`` (renamed into place last) records each file's size
and checksum, checked whenever the entry is opened (see :func:`_open_entry`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from recsys_dist.data import mapping as mp
from recsys_dist.data.criteo import CRITEO, LINE_COLUMN, TRANSFORM_VERSION
from recsys_dist.data.prefetch import prefetched
from recsys_dist.data.splits import SPLITS, Split, position_assign, random_assign, time_assign
from recsys_dist.data.workers import OrderedPool, WorkerDied
from recsys_dist.distributed.stderr_log import StderrHandler
from recsys_dist.errors import DataError

VOCABULARY_FILE = "vocabulary.parquet"
MANIFEST_FILE = "manifest.json"
# The layout of a cache entry and its manifest, part of the entry's key. 1: recsys_dist 0.1.0
# (keys without the defaults, "files" and "integrity" optional); 2: both always there.
CACHE_FORMAT = 2
# Checked entries of this process and the processes it starts (a training run's ranks): the
# entry's path and a signature of its files' stat (size, mtime, ctime, inode). See _open_entry.
CHECKED_ENV = "RECSYS_DIST_CHECKED_CACHE"
OOV_WARN_RATE = 0.5  # warn when more of a feature's validation / test values are out of vocabulary
# Separators a multi-hot text column may use instead of the configured one (see _separator_warnings).
SEPARATOR_CANDIDATES = (",", ";", "|", " ", "/")

try:  # a fast checksum when xxhash is installed, else BLAKE2b (both stream the file)
    import xxhash

    _HASHERS = {"xxh3_64": xxhash.xxh3_64}
except ImportError:  # pragma: no cover - depends on the environment
    _HASHERS = {}
_HASHERS["blake2b"] = lambda: hashlib.blake2b(digest_size=16)
CHECKSUM = next(iter(_HASHERS))


# Data warnings go to stderr whatever the root logger's level (the planner sets it to ERROR).
log = logging.getLogger("recsys_dist.data")
if not log.handlers:
    _handler = StderrHandler()
    _handler.setFormatter(logging.Formatter("recsys-dist: warning: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.WARNING)
    log.propagate = False


@dataclass(frozen=True)
class PreparedData:
    """Paths of the converted splits (a list of paths for a split converted from several
    files), rows per split, and the table size per categorical feature (the configured sizes
    under hash mapping, the vocabulary sizes otherwise)."""

    directory: Path
    files: dict[str, Path | list[Path]]
    rows: dict[str, int]
    num_embeddings: list[int] | None = None

    def paths(self, split: str) -> list[str]:
        """The Parquet file(s) of ``split``, as the loader takes them."""
        f = self.files[split]
        return [str(p) for p in f] if isinstance(f, list) else [str(f)]


def cache_key(
    raws: list[Path],
    sizes: list[int],
    num_rows: int | None,
    split: Split,
    on_bad_row: str,
    fmt,
    mapping: str,
    min_count: int,
    vocabulary: Path | None,
    row_group_size: int = 65536,
    managed: list[bool] | None = None,
) -> str:
    """The name of a conversion's cache entry: a digest of the raw files (path, size, mtime)
    and every option that changes the converted output. Computing it converts nothing."""
    files = [[str(r.resolve()), r.stat().st_size, r.stat().st_mtime_ns] for r in raws]
    key = json.dumps(
        [
            CACHE_FORMAT,
            files,
            sizes,
            num_rows,
            split.fingerprint(),
            TRANSFORM_VERSION,
            on_bad_row,
            getattr(fmt, "fingerprint", fmt.name),
            mapping,
            min_count,
            [str(vocabulary.resolve()), vocabulary.stat().st_mtime_ns] if vocabulary else None,
            row_group_size,
            managed if managed and any(managed) and mapping != "managed" else None,
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("RECSYS_DIST_CACHE", Path.home() / ".cache" / "recsys_dist"))


def check_cache_format(m: dict, out: Path) -> None:
    """Refuse a conversion (cache entry ``out`` with manifest ``m``) of another cache format
    than :data:`CACHE_FORMAT`.

    Raises:
        DataError: naming the entry, the format found, the one expected and the fix.
    """
    found = m.get("cache_format", 1)
    if found == CACHE_FORMAT:
        return
    who = "a newer" if isinstance(found, int) and found > CACHE_FORMAT else "an older"
    raise DataError(
        f"{out}: this conversion was written by {who} recsys_dist (cache format {found!r}; this one reads format "
        f"{CACHE_FORMAT} only): re-run the conversion: delete {out}"
    )


def _manifest_result(out: Path, m: dict) -> PreparedData:
    names = m["files"]
    files = {s: out / names[s][0] if len(names[s]) == 1 else [out / n for n in names[s]] for s in SPLITS}
    return PreparedData(out, files, m["rows"], m["num_embeddings"])


def _flat(tmp: dict) -> list[Path]:
    return [t for v in tmp.values() for t in (v if isinstance(v, list) else [v])]


class _Reader:
    """Record batches of one raw file, bad rows left out under ``skip``, with their split.

    ``cap`` bounds the raw rows read. A batch comes with the index of its first row among
    the rows kept so far (position and random splits go by that index).
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
    ) -> None:
        self.fmt, self.path, self.split, self.fixed, self.cap = fmt, path, split, fixed, cap
        self.bounds, self.skipped = bounds, skipped
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
        if s.column not in batch.schema.names:
            raise DataError(
                f"{self.path}: split column {s.column!r} is not a column of {self.fmt.name} "
                f"(columns: {batch.schema.names})"
            )
        col = batch.column(s.column)
        try:
            values = pc.cast(
                pc.utf8_trim_whitespace(col) if pa.types.is_string(col.type) else col, pa.float64()
            ).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:
            bad = [i for i, v in enumerate(col.to_pylist()) if not _is_number(v)][0]
            raise DataError(
                f"{self.path}, data row {first + bad + 1}, column {s.column}: '{col[bad].as_py()}' "
                "is not a number (split.by time needs a numeric column)"
            ) from None
        if np.isnan(values).any():
            bad = int(np.flatnonzero(np.isnan(values))[0])
            raise DataError(f"{self.path}, data row {first + bad + 1}, column {s.column}: empty (split.by time)")
        return time_assign(values, s.thresholds)


def _is_number(v) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


class _Transform:
    """One block of text columns -> (output record batch, missing count per dense column)."""

    def __init__(self, fmt, sizes: list[int], vocabs, schema: pa.Schema, managed: list[bool]) -> None:
        self.fmt, self.sizes, self.vocabs, self.schema = fmt, sizes, vocabs, schema
        self.managed = managed  # per feature: raw 63-bit keys for a managed-collision module, no reduction

    def __call__(self, batch: pa.RecordBatch, path: str, first: int) -> tuple[pa.RecordBatch, np.ndarray]:
        missing = np.zeros(len(self.fmt.dense_names))
        for j, n in enumerate(self.fmt.dense_names):
            col = batch.column(n)
            missing[j] = (
                (pc.sum(pc.equal(pc.fill_null(col, ""), "")).as_py() or 0)
                if pa.types.is_string(col.type)
                else col.null_count
            )
        labels, dense, sparse = self.fmt.parse_batch(batch, path, first + 1)
        ids = []
        for j, sk in enumerate(sparse):
            if self.managed[j]:
                got = mp.managed_ids(sk.keys)
            elif self.vocabs is not None:
                got = self.vocabs[j].lookup(sk.keys)
            else:
                got = mp.hash_ids(sk.keys, self.sizes[j])
            ids.append(mp.to_arrow(got, sk))
        label_cols = [labels] if labels.ndim == 1 else list(labels.T)
        weights = []
        if getattr(self.fmt, "weight_column", None):
            weights = [pa.array(self.fmt.weights(batch, path, first + 1), pa.float32())]
        out = pa.RecordBatch.from_arrays(
            [pa.array(y, pa.float32()) for y in label_cols]
            + [pa.array(d, pa.float32()) for d in dense]
            + ids
            + weights,
            schema=self.schema,
        )
        return out, missing


class _SplitWriter:
    """One split's Parquet file, written in whole row groups: batches wait until a full row
    group is there (writing each batch as it comes would give 65,536 + 3,712 + 65,536 + ...)."""

    def __init__(self, path: Path, schema: pa.Schema, row_group_size: int) -> None:
        self.path, self.row_group_size = path, row_group_size
        self.writer = pq.ParquetWriter(path, schema)
        self.pending: list = []
        self.rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self.pending.append(batch)
        self.rows += batch.num_rows
        self._flush()

    def _flush(self, force: bool = False) -> None:
        n = sum(b.num_rows for b in self.pending)
        if not self.pending or (n < self.row_group_size and not force):
            return
        table = pa.Table.from_batches(self.pending)
        full = n if force else n - n % self.row_group_size
        self.writer.write_table(table.slice(0, full), row_group_size=self.row_group_size)
        self.pending = table.slice(full).to_batches() if full < n else []

    def close(self) -> None:
        """Write what is pending and close the file."""
        self._flush(force=True)
        self.writer.close()

    def discard(self) -> None:
        self.writer.close()
        self.path.unlink(missing_ok=True)


class _Totals:
    """What a conversion pass adds up besides the rows it writes: the training split's dense
    statistics (count, sum, sum of squares of the transformed values) and label counts, the
    missing count per dense column over all rows, the rows kept (``seen``), under vocabulary
    mapping the present and out-of-vocabulary ids per split and feature (``ids``), and per
    multi-hot text column how many values contain each separator candidate (``separators``)."""

    def __init__(self, num_dense: int, num_sparse: int = 0, multi_hot: list | tuple = ()) -> None:
        self.stats, self.missing = np.zeros((3, num_dense)), np.zeros(num_dense)
        self.labels = np.zeros(2)  # training rows, and of them label 1 (the first task's label)
        self.num_labels = 1
        self.seen, self.n_skipped, self.examples = 0, 0, []
        self.ids = np.zeros((3, 2, num_sparse))  # split, (present ids, OOV ids), feature
        self.multi_hot = list(multi_hot)  # (column, configured separator)
        # per column: {"values": non-empty values, separator: values containing it}, an example each
        self.separators: list[dict] = [{} for _ in self.multi_hot]
        self.separator_examples: list[dict] = [{} for _ in self.multi_hot]

    @classmethod
    def of(cls, transform: _Transform) -> _Totals:
        fmt = transform.fmt
        spec = getattr(fmt, "spec", None)
        multi_hot = [(n, spec.separator) for n in spec.multi_hot] if spec is not None else []
        out = cls(len(fmt.dense_names), len(fmt.sparse_names) if transform.vocabs is not None else 0, multi_hot)
        out.num_labels = len(getattr(fmt, "label_columns", None) or ["label"])  # dense columns follow the labels
        return out

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
        """Count the separators in the raw multi-hot text columns of ``batch``."""
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

    def add(self, other: _Totals) -> None:
        self.stats += other.stats
        self.missing += other.missing
        self.labels += other.labels
        self.seen += other.seen
        self.n_skipped += other.n_skipped
        self.examples = (self.examples + other.examples)[:20]
        self.ids += other.ids
        for mine, theirs in zip(self.separators, other.separators):
            for c, n in theirs.items():
                mine[c] = mine.get(c, 0) + n
        for mine, theirs in zip(self.separator_examples, other.separator_examples):
            for c, v in theirs.items():
                mine.setdefault(c, v)


def _convert(readers: list[_Reader], writers: dict, transform: _Transform, bar=None) -> _Totals:
    """Rows of ``readers`` to the split writers they belong to (``writers[split]``)."""
    t = _Totals.of(transform)
    for reader in readers:
        for batch, first in reader.batches():
            where = reader.assign(batch, first)
            out_batch, block_missing = transform(batch, reader.path, first)
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
            t.seen += batch.num_rows
    return t


class _SourceJob:
    """One raw file whose rows all go to one split, converted to its own Parquet file (run in
    a worker process, see :func:`_convert_in_workers`)."""

    def __init__(self, reader: _Reader, transform: _Transform, schema: pa.Schema, row_group_size: int) -> None:
        self.reader, self.transform, self.schema, self.row_group_size = reader, transform, schema, row_group_size

    def __call__(self, path: str, fixed: int, out_path: str) -> tuple[int, _Totals]:
        r = self.reader
        skipped: list | None = None if r.skipped is None else []
        reader = _Reader(r.fmt, path, r.split, fixed, r.cap, r.bounds, skipped)
        writer = _SplitWriter(Path(out_path), self.schema, self.row_group_size)
        try:
            totals = _convert([reader], {SPLITS[fixed]: writer}, self.transform)
        except BaseException:
            writer.discard()
            raise
        writer.close()
        if skipped is not None:
            totals.n_skipped = _rows_skipped(skipped, [reader])
            totals.examples = [{"file": Path(path).name, "line": ln, "reason": why} for ln, why in skipped[:20]]
        return writer.rows, totals


def _convert_in_workers(
    readers: list[_Reader],
    out: Path,
    transform: _Transform,
    schema: pa.Schema,
    row_group_size: int,
    progress: bool,
    token: str,
) -> tuple[_Totals, dict, dict, dict]:
    """Several raw files, each all one split (``split.by: files`` with several training files):
    each file is converted in a worker process to its own Parquet file, ``<split>.parquet``
    when the split has one file, else ``<split>-00000.parquet``, ... in the order given.
    Returns the totals, rows and file names per split, and the temporary paths (renamed by
    the caller once everything is written; ``token`` makes them this process's own)."""
    per_split = {s: [r for r in readers if SPLITS[r.fixed] == s] for s in SPLITS}
    names = {
        s: [f"{s}.parquet"] if len(rs) == 1 else [f"{s}-{i:05d}.parquet" for i in range(len(rs))]
        for s, rs in per_split.items()
    }
    tmp = {s: [out / f".{n}.{token}.tmp" for n in names[s]] for s in SPLITS}
    jobs = [(r.path, r.fixed, str(tmp[s][i])) for s in SPLITS for i, r in enumerate(per_split[s])]
    totals, rows = _Totals.of(transform), dict.fromkeys(SPLITS, 0)
    bar = tqdm(total=len(jobs), unit="file", desc=f"convert {len(jobs)} files", disable=not progress)
    try:
        with OrderedPool(
            min(len(jobs), os.cpu_count() or 1), _SourceJob(readers[0], transform, schema, row_group_size)
        ) as pool:
            for (_, fixed, _), (n, t) in pool.map(jobs):
                rows[SPLITS[fixed]] += n
                totals.add(t)
                bar.update(1)
    except WorkerDied as err:
        _unlink(tmp)
        raise DataError(f"converting {len(jobs)} files: {err}") from None
    except BaseException:
        _unlink(tmp)
        raise
    bar.close()
    return totals, rows, names, tmp


def _unlink(tmp: dict) -> None:
    for t in _flat(tmp):
        t.unlink(missing_ok=True)


def _recut(
    tmp: dict, schema: pa.Schema, bounds: np.ndarray, row_group_size: int, totals: _Totals
) -> tuple[dict, _Totals]:
    """Rewrite the position splits in ``tmp`` (train, validation, test: consecutive runs of
    the kept rows) at ``bounds``; returns the rows per split and ``totals`` (empty) with the
    counts of the rows as written (training statistics and label counts, ids per split)."""
    writers = {s: _SplitWriter(tmp[s].with_name(tmp[s].name + ".recut.tmp"), schema, row_group_size) for s in SPLITS}
    pos = 0
    try:
        for s in SPLITS:
            for batch in pq.ParquetFile(tmp[s]).iter_batches(batch_size=row_group_size):
                lo = pos
                pos += batch.num_rows
                for k, target in enumerate(SPLITS):
                    a, b = max(lo, int(bounds[k])), min(pos, int(bounds[k + 1]))
                    if a >= b:
                        continue
                    part = batch.slice(a - lo, b - a)
                    writers[target].add(part)
                    totals.add_part(k, part)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    for s in SPLITS:
        os.replace(writers[s].path, tmp[s])
    return {s: w.rows for s, w in writers.items()}, totals


def _position_bounds(fractions, total: int) -> np.ndarray:
    """Row bounds [0, train end, validation end, total] of a position split of ``total`` rows."""
    bounds = np.floor(np.cumsum([0.0, *fractions]) * total + 1e-9).astype(int)
    bounds[-1] = total
    return bounds


def _first_bad_row(readers: list[_Reader], transform: _Transform) -> str | None:
    """The error the first bad row gives under ``on_bad_row: error`` (file, line, column and
    why), read again without skipping; for the message when every row was skipped."""
    for r in readers:
        strict = _Reader(r.fmt, r.path, r.split, r.fixed, r.cap, r.bounds, None)
        try:
            for batch, first in strict.batches():
                transform(batch, strict.path, first)
        except DataError as err:
            return str(err)
    return None


def _rows_skipped(skipped: list, readers: list[_Reader]) -> int:
    """Rows left out: ``skipped`` holds every bad line and up to 20 examples of rejected values
    per block, so the values are counted by the readers instead."""
    return len(skipped) - sum(r.n_examples for r in readers) + sum(r.n_bad_values for r in readers)


def _train_keys(sk: mp.SparseKeys, train: np.ndarray) -> np.ndarray:
    if sk.lengths is None:
        return sk.keys[train & sk.present]
    return sk.keys[np.repeat(train, sk.lengths)]


def _count_vocabularies(fmt, readers: list[_Reader], bar, managed: list[bool]) -> list[mp.VocabularyCounter | None]:
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


def prepare(
    fmt,
    raw_path: str | os.PathLike,
    num_embeddings: int | list[int],
    split=(0.8, 0.1, 0.1),
    num_rows: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    row_group_size: int = 65536,
    on_bad_row: str = "error",
    progress: bool = False,
    mapping: str = "hash",
    min_count: int = 1,
    vocabulary: str | os.PathLike | None = None,
    warn_one_class: bool = True,
    managed: list[bool] | None = None,
) -> PreparedData:
    """Convert raw data of format ``fmt`` to train/validation/test Parquet once, then reuse it.

    Args:
        split: three fractions (position split, file order) or a :class:`splits.Split`
            (position, random with a seed, a time column, or one file per split).
        num_embeddings: table rows per categorical feature (one int for all); under
            ``mapping="vocabulary"`` the largest table allowed (the most frequent values are kept).
        num_rows: read at most this many rows of each raw file.
        mapping: ``"hash"`` or ``"vocabulary"`` (see ``recsys_dist.data.mapping``); the
            vocabulary is built from the training split only (a first pass over its rows).
        min_count: vocabulary: keep a value seen at least this often in the training rows.
        vocabulary: vocabulary: apply this ``vocabulary.parquet`` (from an earlier
            conversion, e.g. the training data when scoring new rows) instead of counting.
        warn_one_class: log a warning when every training row has the same label (e.g. a
            ``label_threshold`` applied to a column that is already 0/1); not an error, since a
            tiny dataset may be one class.

    The output directory is keyed by the raw file(s) (path, size, mtime) and every argument
    that changes the output, so changing any of them converts again. ``on_bad_row="skip"``
    leaves out rows with a wrong field count or a rejected value and records them (rows
    read = rows written + rows skipped) in the manifest; ``"error"`` stops at the first.
    ``progress`` shows a tqdm bar. Files are written under a temporary name of this process
    and renamed, and ``manifest.json`` is written last, so an interrupted conversion is never
    reused. One process at a time converts or checks an entry (a lock file beside it): a
    second one converting the same data waits, then reuses the result. A cached entry is
    checked when opened (every file there, sizes and checksums as the manifest records them);
    a damaged or incomplete one is named in a warning and converted again. Warnings of the
    conversion (one-class labels, an empty test split, high out-of-vocabulary rates, a
    multi-hot separator that looks wrong) are stored in the manifest and repeated on reuse.

    Returns:
        :class:`PreparedData`; ``num_embeddings`` is the table size per feature to train with.

    Raises:
        DataError: malformed input (names the file, line and column), a missing file, or no rows.
    """
    split = Split.of(split)
    raws = [Path(p) for p in raw_path] if isinstance(raw_path, (list, tuple)) else [Path(raw_path)]
    if not raws:
        raise ValueError("raw_path: no file given")
    if len(raws) > 1 and split.by != "files":
        raise ValueError(f"several raw files are the training data of split.by 'files', not split.by {split.by!r}")
    raw = raws[0]
    twice = sorted({str(r) for r in raws if sum(x.resolve() == r.resolve() for x in raws) > 1})
    if twice:
        log.warning(
            f"data.raw_path lists {', '.join(twice)} more than once: its rows will be in the training "
            "split that many times"
        )
    sources = split.sources([str(r) for r in raws])
    for path, _ in sources:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"{p}: {'is a directory, not a file' if p.is_dir() else 'file does not exist'}")
    sparse_names = list(fmt.sparse_names)
    sizes = list(num_embeddings) if isinstance(num_embeddings, (list, tuple)) else [num_embeddings] * len(sparse_names)
    if len(sizes) != len(sparse_names):
        raise ValueError(f"num_embeddings: {len(sizes)} sizes for {len(sparse_names)} features of {fmt.name}")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if mapping not in ("hash", "vocabulary", "managed"):
        raise ValueError(f"mapping must be 'hash', 'vocabulary' or 'managed', got {mapping!r}")
    managed = [True] * len(sparse_names) if mapping == "managed" else list(managed or [False] * len(sparse_names))
    if len(managed) != len(sparse_names):
        raise ValueError(f"managed: {len(managed)} flags for {len(sparse_names)} features of {fmt.name}")
    vocab_path = Path(vocabulary) if vocabulary is not None else None
    if vocab_path is not None and not vocab_path.is_file():
        raise DataError(f"{vocab_path}: vocabulary file does not exist")
    out = Path(cache_dir) if cache_dir else default_cache_dir()
    prefix = "criteo" if fmt.name == "criteo_tsv" else fmt.name
    out = (
        out
        / f"{prefix}-{cache_key(raws, sizes, num_rows, split, on_bad_row, fmt, mapping, min_count, vocab_path, row_group_size, managed)}"
    )
    with _entry_lock(out, raws):
        m = _open_entry(out, raw, warn_one_class)
        if m is None:
            m = _build(
                fmt,
                raws,
                sources,
                out,
                sizes,
                split,
                num_rows,
                on_bad_row,
                mapping,
                min_count,
                vocab_path,
                row_group_size,
                progress,
                warn_one_class,
                managed,
            )
    return _manifest_result(out, m)


def _build(
    fmt,
    raws: list[Path],
    sources: list,
    out: Path,
    sizes: list[int],
    split: Split,
    num_rows: int | None,
    on_bad_row: str,
    mapping: str,
    min_count: int,
    vocab_path: Path | None,
    row_group_size: int,
    progress: bool,
    warn_one_class: bool,
    managed: list[bool],
) -> dict:
    """Convert into the cache entry ``out`` (its lock held; see :func:`prepare` for the
    arguments); returns the manifest, written last."""
    raw = raws[0]
    dense_names, sparse_names = list(fmt.dense_names), list(fmt.sparse_names)
    bounds = None
    skipped: list | None = [] if on_bad_row == "skip" else None
    if split.by == "position":
        total = fmt.count_rows(raw)
        if num_rows is not None:
            total = min(total, num_rows)
        if total == 0:
            raise DataError(f"{raw}: the file holds no rows")
        if skipped is not None and mapping == "vocabulary" and vocab_path is None:
            # The fractions apply to the rows kept, and the vocabulary is counted over the
            # training rows before anything is written: count the kept rows first (one more
            # parse of the file). Under hash mapping the splits are cut again at the end instead.
            counter = _Reader(fmt, str(raw), split, None, num_rows, np.array([0, total, total, total]), [])
            total = sum(batch.num_rows for batch, _ in counter.batches())
        bounds = _position_bounds(split.fractions, total)
    readers = [_Reader(fmt, path, split, fixed, num_rows, bounds, skipped) for path, fixed in sources]
    total_bytes = sum(Path(p).stat().st_size for p, _ in sources)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.tmp"):  # left by a conversion that was killed (the lock is ours now)
        stale.unlink(missing_ok=True)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"  # this process's temporary file names

    vocabs: list[mp.Vocabulary] | None = None
    distinct = None
    if mapping == "vocabulary":
        if vocab_path is not None:
            vocabs = mp.load_vocabularies(vocab_path, sparse_names)
        else:
            first_pass = [
                _Reader(fmt, r.path, split, r.fixed, num_rows, bounds, [] if skipped is not None else None)
                for r in readers
                if r.fixed in (None, 0)
            ]
            with tqdm(
                total=sum(Path(r.path).stat().st_size for r in first_pass),
                unit="B",
                unit_scale=True,
                disable=not progress,
                desc=f"count {raw.name}",
            ) as bar:
                counters = _count_vocabularies(fmt, first_pass, bar, managed)
            distinct = [None if c is None else c.distinct() for c in counters]
            # a managed feature: an empty vocabulary, never looked up (_Transform) nor saved
            vocabs = [mp.Vocabulary.empty() if c is None else c.build(min_count, n) for c, n in zip(counters, sizes)]
            del counters
        # a managed feature keeps its configured rows (the managed module's zch_size)
        sizes = [n if m else v.size for v, n, m in zip(vocabs, sizes, managed)]

    schema = fmt.output_schema()

    transform = _Transform(fmt, sizes, vocabs, schema, managed)
    train_files = [path for path, fixed in sources if fixed == 0]
    if len(train_files) > 1:  # several training files: one worker process per file
        totals, rows, files, tmp = _convert_in_workers(readers, out, transform, schema, row_group_size, progress, token)
        skipped_count, examples = totals.n_skipped, totals.examples
    else:
        tmp = {s: out / f".{s}.parquet.{token}.tmp" for s in SPLITS}
        writers = {s: _SplitWriter(tmp[s], schema, row_group_size) for s in SPLITS}
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"convert {raw.name}", disable=not progress)
        try:
            totals = _convert(readers, writers, transform, bar)
        except BaseException:
            for w in writers.values():
                w.discard()
            raise
        bar.close()
        for w in writers.values():
            w.close()
        rows = {s: w.rows for s, w in writers.items()}
        files = {s: [f"{s}.parquet"] for s in SPLITS}
        skipped_count = _rows_skipped(skipped or [], readers)
        examples = [{"line": ln, "reason": why} for ln, why in (skipped or [])[:20]]
    stats, missing, seen, train_labels = totals.stats, totals.missing, totals.seen, totals.labels
    if seen == 0:
        for t in _flat(tmp):
            t.unlink(missing_ok=True)
        if not skipped_count:
            raise DataError(f"{raw}: no rows could be read (the file holds no rows)")
        first = _first_bad_row(readers, transform)
        raise DataError(
            f"{raw}: no rows could be read: every row ({skipped_count:,}) was skipped as bad (data.on_bad_row: "
            f"skip). The first error, as data.on_bad_row: error reports it: {first or 'none found on reading again'}"
        )
    if bounds is not None and seen != bounds[-1]:
        # Rows were skipped: the bounds (from the line count) would take them all out of the
        # last split. The splits are consecutive runs of the kept rows, so cut them again.
        bounds = _position_bounds(split.fractions, seen)
        try:
            template = _Totals.of(transform)
            rows, recut = _recut(tmp, schema, bounds, row_group_size, template)
            stats, train_labels, totals.ids = recut.stats, recut.labels, recut.ids
        except BaseException:
            for t in tmp.values():
                t.unlink(missing_ok=True)
            raise
    for s in SPLITS:
        for t, name in zip(tmp[s] if isinstance(tmp[s], list) else [tmp[s]], files[s]):
            os.replace(t, out / name)
    transforms = dict(fmt.transforms)
    mapping_info: dict = {"kind": mapping, "missing_id": mp.MISSING_ID}
    if mapping != "managed" and any(managed):
        mapping_info["managed"] = [n for n, m in zip(sparse_names, managed) if m]  # raw 63-bit ids
    if vocabs is not None:
        # The vocabulary features (data.managed.features take raw keys): the file, sizes,
        # counts and OOV rates describe only them.
        vocab_features = [(j, n) for j, (n, m) in enumerate(zip(sparse_names, managed)) if not m]
        vocab_tmp = out / f".{VOCABULARY_FILE}.{token}.tmp"
        mp.save_vocabularies(vocab_tmp, [n for _, n in vocab_features], [vocabs[j] for j, _ in vocab_features])
        os.replace(vocab_tmp, out / VOCABULARY_FILE)
        transforms["sparse"] = (
            f"id = 2 + rank of the value's key ({transforms.get('key', 'see mapping')}) among "
            f"the training split's keys seen >= {min_count} times, by count then key; "
            f"other values -> {mp.OOV_ID} (OOV); empty -> {mp.MISSING_ID}"
        )
        mapping_info.update(
            oov_id=mp.OOV_ID,
            min_count=min_count,
            file=VOCABULARY_FILE,
            source=str(vocab_path.resolve()) if vocab_path else "training split",
            vocabulary_size={n: sizes[j] for j, n in vocab_features},
        )
        if distinct is not None:
            mapping_info["distinct_train_values"] = {n: distinct[j] for j, n in vocab_features}
        # Per split and feature: the fraction of present values (not missing) that are out of vocabulary.
        mapping_info["oov_rate"] = {
            s: {
                n: float(totals.ids[k, 1, j] / totals.ids[k, 0, j]) if totals.ids[k, 0, j] else None
                for j, n in vocab_features
            }
            for k, s in enumerate(SPLITS)
        }
    split_info = split.describe()
    if bounds is not None:
        split_info["row_bounds"] = bounds.tolist()
    warnings = _conversion_warnings(fmt, raw, split, rows, train_labels, totals, mapping_info, vocab_path)
    manifest = {
        "cache_format": CACHE_FORMAT,
        "source": str(raw.resolve()) if len(raws) == 1 else [str(r.resolve()) for r in raws],
        "format": fmt.name,
        "rows": rows,
        "files": files,
        "row_group_size": row_group_size,
        "num_embeddings": sizes,
        "categorical_mapping": mapping_info,
        "dense": dense_names,
        "sparse": sparse_names,
        "schema": {f.name: str(f.type) for f in schema},
        # task -> binary | regression, in the order of the label columns; the sample-weight column
        "tasks": dict(zip(getattr(fmt, "task_names", ["label"]), getattr(fmt, "task_kinds", ["binary"]))),
        "weight": getattr(fmt, "weight_column", None),
        "transforms": transforms,
        "split": split_info,
        "rows_written": seen,
        "rows_skipped": skipped_count,
        "skipped_examples": examples,
        "dense_stats_train": {
            n: {
                "mean": float(stats[1, j] / stats[0, j]) if stats[0, j] else None,
                "std": float(np.sqrt(max(stats[2, j] / stats[0, j] - (stats[1, j] / stats[0, j]) ** 2, 0)))
                if stats[0, j]
                else None,
                "missing_fraction": float(missing[j] / seen) if seen else None,
            }
            for j, n in enumerate(dense_names)
        },
        "warnings": warnings,
    }
    manifest["integrity"] = _integrity(out, _entry_files(manifest))
    _write_manifest(out, manifest)
    _mark_checked(out, _signature(out, _entry_files(manifest)))
    _emit_warnings(manifest, warn_one_class)
    return manifest


# ------------------------------------------------------------------------- warnings


def _conversion_warnings(
    fmt, raw: Path, split: Split, rows: dict, train_labels, totals: _Totals, mapping_info: dict, vocab_path
) -> list[dict]:
    """What a conversion warns about, as ``{"kind", "message"}`` entries: stored in the
    manifest, so a cached conversion that is reused repeats them (:func:`_emit_warnings`)."""
    out = []
    if train_labels[0] and train_labels[1] in (0, train_labels[0]):
        out.append(
            {
                "kind": "one_class",
                "message": _one_class_message(fmt, raw, int(train_labels[0]), int(train_labels[1] > 0)),
            }
        )
    wants_test = split.by in ("time", "files") or split.fractions[2] > 0
    if rows["test"] == 0 and rows["train"] and wants_test:
        if split.by == "time":
            hint = (
                f"no value of {split.column} is >= data.split.thresholds[1] ({split.thresholds[1]:g}); "
                "lower the threshold"
            )
        elif split.by == "files":
            hint = f"the test file {split.test_path} holds no rows"
        else:
            hint = "give more rows or a larger test fraction in data.split"
        out.append(
            {
                "kind": "empty_test",
                "message": f"{raw}: the test split is empty (train {rows['train']}, validation "
                f"{rows['validation']}, test 0 rows), so no test metrics will be reported: {hint}",
            }
        )
    rates = mapping_info.get("oov_rate")
    if rates and vocab_path is None:
        for s in ("validation", "test"):
            high = {n: r for n, r in rates[s].items() if r is not None and r > OOV_WARN_RATE}
            if high:
                listed = ", ".join(f"{n} {r:.0%}" for n, r in high.items())
                out.append(
                    {
                        "kind": "oov_rate",
                        "message": f"{raw}: in the {s} split, most values of {listed} are out of "
                        f"vocabulary (not seen >= {mapping_info['min_count']} times in the training split): "
                        f"they all share the out-of-vocabulary id {mp.OOV_ID}, so the model cannot tell them "
                        "apart. Check that data.split leaves such values in the training rows, lower "
                        "data.min_count, or use data.categorical_mapping: hash (rates per feature: "
                        "categorical_mapping.oov_rate in manifest.json)",
                    }
                )
    out += _separator_warnings(raw, totals)
    return out


def _separator_warnings(raw: Path, totals: _Totals) -> list[dict]:
    """A multi-hot text column in which almost no value holds the configured separator but
    many hold another common one: every combination would silently be one token."""
    out = []
    for (name, sep), counts, examples in zip(totals.multi_hot, totals.separators, totals.separator_examples):
        n = counts.get("values", 0)
        if not n or counts.get(sep, 0) > 0.01 * n:
            continue
        found = [(counts.get(c, 0), c) for c in SEPARATOR_CANDIDATES if c != sep and counts.get(c, 0) >= 0.2 * n]
        if not found:
            continue
        # A space is the weakest sign (values may be phrases): any other candidate first.
        best = max(found, key=lambda nc: (nc[1] != " ", nc[0]))[1]
        out.append(
            {
                "kind": "separator",
                "message": f"{raw}: multi-hot column {name}: {counts.get(sep, 0)} of {n} values contain the "
                f"separator {sep!r} (data.schema.separator), but {counts[best]} contain {best!r} (e.g. "
                f"{examples[best]!r}), so each whole value is one token; if {best!r} separates the "
                f"elements, set data.schema.separator: {best!r}",
            }
        )
    return out


def _one_class_message(fmt, raw: Path, n: int, label: int) -> str:
    """Every training row has the same label: say which column and threshold made it so."""
    column = getattr(fmt, "label_column", "label")
    spec = getattr(fmt, "spec", None)
    threshold = getattr(spec, "label_threshold", None)
    if threshold is not None:
        rule = (
            f"label = 1 if {column} >= {threshold:g} (data.schema.label_threshold); if {column} already holds "
            "0/1, remove label_threshold"
        )
    else:
        rule = f"label = the {column} column"
    return (
        f"{raw}: all {n} training rows have label {label} ({rule}); the model will only see one class. "
        "Check the label column and the split."
    )


def _emit_warnings(manifest: dict, warn_one_class: bool) -> None:
    for w in manifest.get("warnings", []):
        if w.get("kind") != "one_class" or warn_one_class:
            log.warning(w["message"])


# ------------------------------------------------------------------------- the cache entry


@contextmanager
def _entry_lock(out: Path, raws: list[Path]):
    """Hold the cache entry ``out`` alone: an exclusive ``flock`` on ``<out>.lock`` beside it
    (created if need be, never removed: removing a lock file races with its next user). A
    second process waits here until the first has converted, then reuses its result. The
    lock goes with the process (the kernel drops it when the process dies, however it dies).

    A cache directory where the lock file cannot be created (read only) is used without the
    lock when the entry is complete already."""
    lock_path = out.parent / f"{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        if (out / MANIFEST_FILE).is_file():
            yield
            return
        raise DataError(
            f"{lock_path}: cannot create the cache entry's lock file ({err.strerror}); data.cache_dir "
            "(or $RECSYS_DIST_CACHE) must be a writable directory"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            what = raws[0] if len(raws) == 1 else f"{len(raws)} files"
            log.warning(
                f"another process is converting {what} into {out} (it holds {lock_path}); waiting for it to finish"
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _entry_files(m: dict) -> list[str]:
    """The data files of a manifest's entry: every split file, and the vocabulary if any."""
    names = m["files"]
    vocab = (m.get("categorical_mapping") or {}).get("file")
    return [n for s in SPLITS for n in names[s]] + ([vocab] if vocab else [])


def _checksums(paths: list[Path], algorithm: str) -> list[str]:
    """The checksum of each file, read in 8 MB pieces (files in parallel: hashing releases the GIL)."""

    def one(path: Path) -> str:
        h = _HASHERS[algorithm]()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        return h.hexdigest()

    if len(paths) <= 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(one, paths))


def _integrity(out: Path, names: list[str]) -> dict:
    """The manifest's ``integrity`` entry: size and checksum of each file of the entry."""
    sums = _checksums([out / n for n in names], CHECKSUM)
    return {
        "algorithm": CHECKSUM,
        "files": {n: {"size": (out / n).stat().st_size, "checksum": c} for n, c in zip(names, sums)},
    }


def train_identity(directory: Path) -> dict | None:
    """What a checkpoint records of the training split it was trained on: ``fingerprint``
    (16 hex digits over the size and checksum of each training file, as the entry's manifest
    records them: the content, whatever the raw file's name, date or cache directory),
    ``rows``, ``algorithm`` (the checksum's) and ``entry`` (the cache entry's name); None
    for an entry whose manifest lists no training file.

    Raises:
        DataError: an entry of another cache format (:func:`check_cache_format`).
    """
    m = json.loads((Path(directory) / MANIFEST_FILE).read_text())
    check_cache_format(m, Path(directory))
    names = m["files"]["train"]
    integrity = m["integrity"]
    files = integrity["files"]
    if not names:
        return None
    h = hashlib.blake2b(digest_size=8)
    for n in names:
        h.update(f"{files[n]['size']}:{files[n]['checksum']};".encode())
    return {
        "fingerprint": h.hexdigest(),
        "rows": int(m["rows"]["train"]),
        "algorithm": integrity.get("algorithm"),
        "entry": Path(directory).name,
    }


def _write_manifest(out: Path, manifest: dict) -> None:
    """Write ``manifest.json`` under a name of this process and rename it into place (a
    reader sees the old manifest or the new one, never half of one)."""
    tmp = out / f".{MANIFEST_FILE}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST_FILE)


def _signature(out: Path, names: list[str]) -> str:
    """The stat (size, mtime, ctime, inode) of the entry's files and manifest, hashed with the
    entry's path: a file written or replaced since changes it."""
    h = hashlib.blake2b(str(out.resolve()).encode(), digest_size=12)
    for n in [*names, MANIFEST_FILE]:
        st = (out / n).stat()
        h.update(f"{n}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino};".encode())
    return h.hexdigest()


def _checked_before(signature: str) -> bool:
    return signature in os.environ.get(CHECKED_ENV, "").split(",")


def _mark_checked(out: Path, signature: str) -> None:
    """Record in the environment (inherited by the ranks this process starts) that the entry,
    as its files are now, was checked and its warnings shown."""
    seen = [s for s in os.environ.get(CHECKED_ENV, "").split(",") if s and s != signature]
    os.environ[CHECKED_ENV] = ",".join([*seen[-31:], signature])


def _check_entry(out: Path, m: dict, names: list[str], full: bool) -> tuple[str, str] | None:
    """``(file, what is wrong)`` for the first missing or damaged file of the entry, or None.
    Sizes are always compared with the manifest's; checksums when ``full``."""
    for n in names:
        if not (out / n).is_file():
            return n, "the file is missing"
    integrity = m["integrity"]
    for n in names:
        want = integrity["files"].get(n, {}).get("size")
        got = (out / n).stat().st_size
        if want != got:
            return (
                n,
                f"{got:,} bytes where the manifest records {want:,}" if want is not None else "not in the manifest",
            )
    algorithm = integrity.get("algorithm")
    if full and algorithm in _HASHERS:
        for n, c in zip(names, _checksums([out / n for n in names], algorithm)):
            if c != integrity["files"][n].get("checksum"):
                return n, f"its {algorithm} checksum differs from the one recorded when it was written"
    return None


def _open_entry(out: Path, raw: Path, warn_one_class: bool) -> dict | None:
    """The manifest of the cache entry ``out`` if the entry is complete and intact, else None
    (no entry, or a damaged one, whose files are then removed so that it is converted again).

    Every file must be there with the size the manifest records. Its checksum is compared too,
    unless this process or the one that started it (a training run's launcher) checked the
    entry already and no file was written since (the files' stat, ``CHECKED_ENV``): so the
    process that opens the cache before any rank starts reads every file once, and the ranks
    after it only compare sizes. A checked entry's warnings are shown again (they were shown by
    the conversion that wrote it)."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
        if not isinstance(m, dict):  # JSON, but not the object a conversion writes
            raise ValueError(f"a JSON {type(m).__name__}, not an object")
        old = {"format", "rows", "num_embeddings"} <= m.keys() and m.get("cache_format") != CACHE_FORMAT
        if not old:
            names = _entry_files(m)
            m["rows"], m["num_embeddings"], m["integrity"]["files"]  # noqa: B018 - present in every manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        _discard(out, [], MANIFEST_FILE, f"not a readable manifest ({err})", raw)
        return None
    if old:  # a conversion of another format: refused, not rebuilt over
        check_cache_format(m, out)
    problem = _check_entry(out, m, names, full=False)
    if problem is None:
        signature = _signature(out, names)
        if not _checked_before(signature):
            problem = _check_entry(out, m, names, full=True)
            if problem is None:
                _emit_warnings(m, warn_one_class)
                _mark_checked(out, signature)
    if problem is not None:
        _discard(out, names, *problem, raw)
        return None
    return m


def _discard(out: Path, names: list[str], name: str, why: str, raw: Path) -> None:
    """Remove a damaged entry's manifest (first: the entry is incomplete from then on) and
    files, saying which file was damaged; it is then converted again."""
    log.warning(f"{out / name}: {why}; the cached conversion in {out} is damaged: converting {raw} again")
    try:
        for n in [MANIFEST_FILE, *names]:
            (out / n).unlink(missing_ok=True)
    except OSError as err:
        raise DataError(
            f"{out / name}: {why}, so the cached conversion in {out} is damaged, and it cannot be removed "
            f"({err.strerror}): delete {out} and run again"
        ) from None


def prepare_criteo(
    raw_path,
    num_embeddings,
    split=(0.8, 0.1, 0.1),
    num_rows=None,
    cache_dir=None,
    row_group_size: int = 65536,
    on_bad_row: str = "error",
    progress: bool = False,
    **kw,
):
    """Convert a Criteo TSV file to train/validation/test Parquet once, then reuse it
    (see :func:`recsys_dist.data.convert.prepare`)."""
    return prepare(
        CRITEO, raw_path, num_embeddings, split, num_rows, cache_dir, row_group_size, on_bad_row, progress, **kw
    )
