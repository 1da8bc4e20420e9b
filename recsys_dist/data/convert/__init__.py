"""Raw file(s) -> train / validation / test Parquet, streamed in bounded memory, cached.

Format-independent: a format object (a ``formats.base.RawFormat``: ``CRITEO``, ``AVAZU``,
``SchemaFormat``) reads blocks of text columns, finds bad rows and parses a block into
labels, dense columns and categorical keys; this module assigns rows to splits
(``splits.Split``), maps keys to ids (``mapping``: hash, or a vocabulary counted over the
training rows in a first pass), writes full-size row groups and writes the manifest last.

A cache entry (one directory per raw file and conversion settings) is converted by one process
at a time: an exclusive ``fcntl.flock`` on ``<entry>.lock`` beside the entry's directory is
held while the entry is checked, converted or rebuilt, so a second process converting the same
data waits and then reuses the result. Every file is written under a name of its own process
and renamed into place; ``manifest.json`` (renamed into place last) records each file's size
and checksum, checked whenever the entry is opened (see ``cache.open_entry``).

Modules: ``spec`` (:class:`ConversionSpec`, what a conversion reads and how), ``passes``
(reading, transforming, counting), ``writer`` (split files), ``parallel`` (one worker process
per file), ``cache`` (entry key, lock, integrity), ``manifest``.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from recsys_dist.data import mapping as mp
from recsys_dist.data.convert import passes
from recsys_dist.data.convert.cache import (
    cache_key,
    default_cache_dir,
    entry_lock,
    entry_signature,
    file_integrity,
    mark_checked,
    open_entry,
)
from recsys_dist.data.convert.manifest import (
    CACHE_FORMAT,
    VOCABULARY_FILE,
    PreparedData,
    conversion_warnings,
    dense_stats,
    describe_mapping,
    emit_warnings,
    entry_files,
    log,
    manifest_result,
    write_manifest,
)
from recsys_dist.data.convert.parallel import convert_in_workers
from recsys_dist.data.convert.passes import (
    Reader,
    Totals,
    Transform,
    count_vocabularies,
    first_bad_row,
    in_line_order,
    position_bounds,
    rows_skipped,
)
from recsys_dist.data.convert.spec import ConversionSpec
from recsys_dist.data.convert.writer import SplitWriter, flat_paths, recut_splits
from recsys_dist.data.coverage import hash_coverage, vocabulary_coverage
from recsys_dist.data.formats.base import RawFormat
from recsys_dist.data.splits import SPLITS, Split
from recsys_dist.errors import DataError, NoRows


def prepare(
    spec: ConversionSpec, *, progress: bool = False, warn_one_class: bool = True, coverage: bool = True
) -> PreparedData:
    """Convert the raw data ``spec`` describes to train/validation/test Parquet once, then reuse it.

    Args:
        spec: the raw files, their format and every setting of the output (:class:`ConversionSpec`).
        progress: show a tqdm bar.
        warn_one_class: log a warning when every training row has the same label (e.g. a
            ``label_threshold`` applied to a column that is already 0/1); not an error, since a
            tiny dataset may be one class.
        coverage: count the share of training values each table gives a row of their own and
            warn (``recsys_dist.data.coverage``); False for stream partitions and scoring.

    The output directory is keyed by the raw file(s) (path, size, mtime) and every field of
    ``spec`` that changes the output, so changing any of them converts again. ``on_bad_row="skip"``
    leaves out rows with a wrong field count or a rejected value and records them (rows
    read = rows written + rows skipped) in the manifest; ``"error"`` stops at the first.
    Files are written under a temporary name of this process and renamed, and ``manifest.json``
    is written last, so an interrupted conversion is never reused. One process at a time
    converts or checks an entry (a lock file beside it): a second one converting the same data
    waits, then reuses the result. A cached entry is checked when opened (every file there,
    sizes and checksums as the manifest records them); a damaged or incomplete one is named in
    a warning and converted again. Warnings of the conversion (one-class labels, an empty test
    split, high out-of-vocabulary rates, a multi-hot separator that looks wrong) are stored in
    the manifest and repeated on reuse.

    Returns:
        :class:`PreparedData`; ``num_embeddings`` is the table size per feature to train with.

    Raises:
        DataError: malformed input (names the file, line and column), a missing file, or no rows.
        ValueError: an option of ``spec`` that does not fit its format or is unknown.
    """
    conversion = _conversion(spec, progress, warn_one_class, coverage)
    with entry_lock(conversion.out, conversion.raws):
        m = open_entry(conversion.out, conversion.raws[0], warn_one_class)
        if m is None:
            m = conversion.build()
    return manifest_result(conversion.out, m)


def entry_path(spec: ConversionSpec) -> Path:
    """The cache entry :func:`prepare` of ``spec`` uses (its directory, which holds
    ``manifest.json`` once converted); reads nothing but the raw files' size and mtime.

    Raises:
        DataError, ValueError: as :func:`prepare` for a missing raw file or a bad option.
    """
    return _conversion(spec, False, True, True).out


def _conversion(spec: ConversionSpec, progress: bool, warn_one_class: bool, coverage: bool) -> _Conversion:
    """The conversion of ``spec`` into its cache entry, every option checked (see :func:`prepare`)."""
    split, raws, sources = _check_sources(spec.raw_path, spec.split)
    sizes, managed, vocab_path = _check_options(
        spec.fmt, spec.num_embeddings, spec.on_bad_row, spec.mapping, spec.managed, spec.vocabulary
    )
    return _Conversion(
        spec.fmt,
        raws,
        sources,
        spec.cache_dir,
        sizes,
        split,
        spec.num_rows,
        spec.on_bad_row,
        spec.mapping,
        spec.min_count,
        vocab_path,
        spec.row_group_size,
        progress,
        warn_one_class,
        managed,
        coverage,
    )


def _check_options(fmt, num_embeddings, on_bad_row: str, mapping: str, managed, vocabulary):
    """(table size per feature, raw-keys flag per feature (managed or ``fmt.value_names``),
    vocabulary path or None), checked.

    Raises:
        ValueError: a count that does not match the format's features, an unknown option.
        DataError: a vocabulary file that does not exist.
    """
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
    # raw-valued features (data.schema.history.times) keep their values like managed ones: no vocabulary, no hash
    values = set(getattr(fmt, "value_names", []))
    managed = [m or n in values for m, n in zip(managed, sparse_names)]
    if not isinstance(num_embeddings, (list, tuple)):  # a list is the conversion's own (a record's)
        sizes = [mp.NO_TABLE_ROWS if n in values else s for n, s in zip(sparse_names, sizes)]
    vocab_path = Path(vocabulary) if vocabulary is not None else None
    if vocab_path is not None and not vocab_path.is_file():
        raise DataError(f"{vocab_path}: vocabulary file does not exist")
    return sizes, managed, vocab_path


def _check_sources(raw_path, split) -> tuple[Split, list[Path], list]:
    """(the :class:`Split`, the raw files, ``split.sources`` of them: (path, fixed split or None)),
    each file checked to be one.

    Raises:
        ValueError: no file, or several files without ``split.by: files``.
        DataError: a file that does not exist or is a directory.
    """
    split = Split.of(split)
    if raw_path is None:
        raw_path = []
    raws = [Path(p) for p in raw_path] if isinstance(raw_path, (list, tuple)) else [Path(raw_path)]
    if not raws:
        raise ValueError("raw_path: no file given")
    if len(raws) > 1 and split.by != "files":
        raise ValueError(f"several raw files are the training data of split.by 'files', not split.by {split.by!r}")
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
    return split, raws, sources


@dataclass
class _Conversion:
    """One conversion into the cache entry ``out`` (named by the raw files and the settings, in
    ``cache_dir``; its lock held while converting): a :class:`ConversionSpec` checked (see
    :func:`_conversion`) and :func:`prepare`'s options. ``sizes`` become the vocabulary sizes
    under vocabulary mapping."""

    fmt: RawFormat
    raws: list[Path]
    sources: list
    cache_dir: str | os.PathLike | None
    sizes: list[int]
    split: Split
    num_rows: int | None
    on_bad_row: str
    mapping: str
    min_count: int
    vocab_path: Path | None
    row_group_size: int
    progress: bool
    warn_one_class: bool
    managed: list[bool]
    coverage: bool = True
    out: Path = field(init=False)

    def __post_init__(self) -> None:
        # The one place an entry is named (scoring looks entries up through entry_path). Criteo's keep
        # the name they had before there were other formats: criteo-<key> (docs/runs.md).
        prefix = "criteo" if self.fmt.name == "criteo_tsv" else self.fmt.name
        key = cache_key(
            self.raws,
            self.sizes,
            self.num_rows,
            self.split,
            self.on_bad_row,
            self.fmt,
            self.mapping,
            self.min_count,
            self.vocab_path,
            self.row_group_size,
            self.managed,
        )
        self.out = (Path(self.cache_dir) if self.cache_dir else default_cache_dir()) / f"{prefix}-{key}"

    def build(self) -> dict:
        """Convert; returns the manifest, written last."""
        fmt, raw = self.fmt, self.raws[0]
        skipped: list | None = [] if self.on_bad_row == "skip" else None
        bounds = self._bounds(skipped)
        last = self._last_rows(skipped)
        readers = [
            Reader(fmt, path, self.split, fixed, self.num_rows, bounds, skipped, last) for path, fixed in self.sources
        ]
        self.out.mkdir(parents=True, exist_ok=True)
        for stale in self.out.glob(".*.tmp"):  # left by a conversion that was killed (the lock is ours now)
            stale.unlink(missing_ok=True)
        token = f"{os.getpid()}-{secrets.token_hex(4)}"  # this process's temporary file names
        vocabs, distinct, coverage = self._vocabularies(readers, bounds, skipped)
        schema = fmt.output_schema()
        transform = Transform(fmt, self.sizes, vocabs, schema, self.managed, self.coverage)
        totals, rows, files, tmp, skipped_count, examples = self._write(readers, transform, schema, token, skipped)
        stats, train_labels = totals.stats, totals.labels
        if totals.seen == 0:
            for t in flat_paths(tmp):
                t.unlink(missing_ok=True)
            if not skipped_count:
                raise NoRows(f"{raw}: no rows could be read (the file holds no rows)")
            first = first_bad_row(readers, transform)
            raise DataError(
                f"{raw}: no rows could be read: every row ({skipped_count:,}) was skipped as bad (data.on_bad_row: "
                f"skip). The first error, as data.on_bad_row: error reports it: {first or 'none found on reading again'}"
            )
        if bounds is not None and totals.seen != bounds[-1]:
            # Rows were skipped: the bounds (from the line count) would take them all out of the
            # last split. The splits are consecutive runs of the kept rows, so cut them again.
            bounds = position_bounds(self.split.fractions, totals.seen)
            try:
                rows, recut = recut_splits(tmp, schema, bounds, self.row_group_size, Totals.of(transform))
                stats, train_labels, totals.ids = recut.stats, recut.labels, recut.ids
                totals.recut = True  # the key counts (sketches, causes) were of the splits first cut
            except BaseException:
                for t in tmp.values():
                    t.unlink(missing_ok=True)
                raise
        for s in SPLITS:
            for t, name in zip(tmp[s] if isinstance(tmp[s], list) else [tmp[s]], files[s]):
                os.replace(t, self.out / name)
        written = (rows, files, stats, train_labels, skipped_count, examples)
        return self._finish(schema, bounds, vocabs, (distinct, coverage), totals, written, token)

    def _bounds(self, skipped: list | None) -> np.ndarray | None:
        """Row bounds of a position split (None for the other kinds); reads the file once."""
        fmt, raw, num_rows = self.fmt, self.raws[0], self.num_rows
        if self.split.by != "position":
            return None
        total = fmt.count_rows(raw)
        if num_rows is not None:
            total = min(total, num_rows)
        if total == 0:
            raise NoRows(f"{raw}: the file holds no rows")
        if skipped is not None and self.mapping == "vocabulary" and self.vocab_path is None:
            # The fractions apply to the rows kept, and the vocabulary is counted over the
            # training rows before anything is written: count the kept rows first (one more
            # parse of the file). Under hash mapping the splits are cut again at the end instead.
            counter = Reader(fmt, str(raw), self.split, None, num_rows, np.array([0, total, total, total]), [])
            total = sum(batch.num_rows for batch, _ in counter.batches())
        return position_bounds(self.split.fractions, total)

    def _last_rows(self, skipped: list | None) -> tuple | None:
        """Under ``split.by: leave_last_out``: (validation, test) row indices of the rows kept,
        from a first pass over the user and time columns (None for the other kinds)."""
        if self.split.by != "leave_last_out":
            return None
        first = Reader(
            self.fmt, str(self.raws[0]), self.split, None, self.num_rows, None, None if skipped is None else []
        )
        return passes.last_event_rows(first)

    def _vocabularies(self, readers: list[Reader], bounds, skipped: list | None) -> tuple:
        """(vocabulary per feature or None, distinct training values per feature or None, the
        coverage of each feature's table (``coverage.vocabulary_coverage``) or None); under
        vocabulary mapping ``sizes`` become the vocabulary sizes."""
        if self.mapping != "vocabulary":
            return None, None, None
        distinct = coverage = None
        if self.vocab_path is not None:
            vocabs = mp.load_vocabularies(self.vocab_path, list(self.fmt.sparse_names))
        else:
            first_pass = [
                Reader(
                    self.fmt,
                    r.path,
                    self.split,
                    r.fixed,
                    self.num_rows,
                    bounds,
                    [] if skipped is not None else None,
                    r.last_rows,
                )
                for r in readers
                if r.fixed in (None, 0)
            ]
            with tqdm(
                total=sum(Path(r.path).stat().st_size for r in first_pass),
                unit="B",
                unit_scale=True,
                disable=not self.progress,
                desc=f"count {self.raws[0].name}",
            ) as bar:
                counters = count_vocabularies(self.fmt, first_pass, bar, self.managed)
            distinct = [None if c is None else c.distinct() for c in counters]
            # a managed feature: an empty vocabulary, never looked up (Transform) nor saved
            vocabs = [
                mp.Vocabulary.empty() if c is None else c.build(self.min_count, n) for c, n in zip(counters, self.sizes)
            ]
            coverage = [
                None if c is None else vocabulary_coverage(c.counts, v.counts, self.min_count)
                for c, v in zip(counters, vocabs)
            ]
            del counters
        # a managed feature keeps its configured rows (the managed module's zch_size)
        self.sizes = [n if m else v.size for v, n, m in zip(vocabs, self.sizes, self.managed)]
        return vocabs, distinct, coverage

    def _write(self, readers: list[Reader], transform: Transform, schema, token: str, skipped: list | None):
        """Convert every row into temporary split files: (totals, rows per split, file names per
        split, temporary paths per split, rows skipped, examples of skipped rows)."""
        train_files = [path for path, fixed in self.sources if fixed == 0]
        if len(train_files) > 1:  # several training files: one worker process per file
            totals, rows, files, tmp = convert_in_workers(
                readers, self.out, transform, schema, self.row_group_size, self.progress, token
            )
            return totals, rows, files, tmp, totals.n_skipped, totals.examples
        tmp = {s: self.out / f".{s}.parquet.{token}.tmp" for s in SPLITS}
        writers = {s: SplitWriter(tmp[s], schema, self.row_group_size) for s in SPLITS}
        total_bytes = sum(Path(p).stat().st_size for p, _ in self.sources)
        name = self.raws[0].name
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"convert {name}", disable=not self.progress)
        try:
            totals = passes.convert_rows(readers, writers, transform, bar)
        except BaseException:
            for w in writers.values():
                w.discard()
            raise
        bar.close()
        for w in writers.values():
            w.close()
        rows = {s: w.rows for s, w in writers.items()}
        files = {s: [f"{s}.parquet"] for s in SPLITS}
        examples = [{"line": ln, "reason": why} for ln, why in in_line_order(skipped or [])[:20]]
        return totals, rows, files, tmp, rows_skipped(skipped or [], readers), examples

    def _finish(self, schema, bounds, vocabs, counted: tuple, totals: Totals, written: tuple, token: str) -> dict:
        """Save the vocabulary, then write the manifest (last); returns it. ``counted``: the
        counting pass's (distinct values, coverage) per feature, or Nones."""
        fmt, raw, out, sizes = self.fmt, self.raws[0], self.out, self.sizes
        distinct, coverage = counted
        rows, files, stats, train_labels, skipped_count, examples = written
        sparse_names = list(fmt.sparse_names)
        transforms = dict(fmt.transforms)
        vocabulary = None
        if vocabs is not None:
            # The vocabulary features (data.managed.features take raw keys): the file, sizes,
            # counts and OOV rates describe only them.
            vocab_features = [(j, n) for j, (n, m) in enumerate(zip(sparse_names, self.managed)) if not m]
            vocab_tmp = out / f".{VOCABULARY_FILE}.{token}.tmp"
            mp.save_vocabularies(vocab_tmp, [n for _, n in vocab_features], [vocabs[j] for j, _ in vocab_features])
            os.replace(vocab_tmp, out / VOCABULARY_FILE)
            source = str(self.vocab_path.resolve()) if self.vocab_path else "training split"
            vocabulary = dict(
                vocab_features=vocab_features,
                min_count=self.min_count,
                sizes=sizes,
                source=source,
                distinct=distinct,
                ids=totals.ids,
            )
        mapping_info = describe_mapping(self.mapping, self.managed, sparse_names, vocabulary, transforms)
        tables = self._coverage(coverage, totals)
        if tables is not None:
            mapping_info["coverage"] = tables
        split_info = self.split.describe()
        if bounds is not None:
            split_info["row_bounds"] = bounds.tolist()
        warnings = conversion_warnings(
            fmt, raw, self.split, rows, train_labels, totals, mapping_info, self.vocab_path, self.coverage
        )
        manifest = {
            "cache_format": CACHE_FORMAT,
            "source": str(raw.resolve()) if len(self.raws) == 1 else [str(r.resolve()) for r in self.raws],
            "format": fmt.name,
            "rows": rows,
            "files": files,
            "row_group_size": self.row_group_size,
            "num_embeddings": sizes,
            "categorical_mapping": mapping_info,
            "dense": list(fmt.dense_names),
            "sparse": sparse_names,
            "schema": {f.name: str(f.type) for f in schema},
            # task -> binary | regression, in the order of the label columns; the sample-weight column
            "tasks": dict(zip(fmt.task_names, fmt.task_kinds)),
            "weight": fmt.weight_column,
            "transforms": transforms,
            "split": split_info,
            "rows_written": totals.seen,
            "rows_skipped": skipped_count,
            "skipped_examples": examples,
            "dense_stats_train": dense_stats(list(fmt.dense_names), stats, totals.missing, totals.seen),
            "warnings": warnings,
            # what a scoring request may send: the raw file's columns (ids.IdText), and the id
            # columns whose values were all integers (a JSON float maps to the integer's id there)
            "raw_columns": totals.id_text.raw_columns if totals.id_text else None,
            "integer_columns": totals.id_text.integer_columns() if totals.id_text else None,
        }
        manifest["integrity"] = file_integrity(out, entry_files(manifest))
        write_manifest(out, manifest)
        mark_checked(out, entry_signature(out, entry_files(manifest)))
        emit_warnings(manifest, self.warn_one_class)
        return manifest

    def _coverage(self, counted: list | None, totals: Totals) -> dict | None:
        """The manifest's ``categorical_mapping.coverage``: per feature with a table of its own
        (not managed), how many training values it gives a row (``recsys_dist.data.coverage``);
        None when not counted (a given vocabulary, ``coverage`` off, managed mapping)."""
        names = list(self.fmt.sparse_names)
        if counted is not None:
            return {n: c for n, c in zip(names, counted) if c is not None}
        if not totals.sketches:
            return None
        return {
            n: hash_coverage(sk, size, exact_rows=not totals.recut)
            for n, sk, size in zip(names, totals.sketches, self.sizes)
            if sk is not None
        }
