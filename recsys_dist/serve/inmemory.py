"""Request rows scored in memory: the training conversion's own code on a table of the rows'
raw columns, the batch built as the loader builds it, and no file, cache entry or thread.

:func:`row_scorer` chooses, once per loaded model, how ``POST /score`` converts its rows:

- :class:`InMemoryScorer` (``kind == "in-memory"``) for a model whose preprocessing record
  matches what this recsys_dist converts (transform version, features, table sizes, mapping):
  any format with a request side (``RawFormat.request_layout()``; the shipped ones with their
  categorical, multi-hot, dense, sequence and history columns, text or Parquet), mappings hash,
  vocabulary (the export's ``vocabulary.parquet``) and managed. Rows given as objects become a
  pyarrow table of text columns (``RowWriter``'s own value rules: the text the file route writes
  and its reader reads back), with the layout's placeholder columns, read by the layout's
  ``reader()``; rows given as text lines are read
  by the format's own ``read_chunks`` from a temporary file (the conversion's reader, lines and
  quoting as ``predict`` reads them). Then the conversion's ``passes.Transform`` (the format's
  ``parse_batch``, its dense transform and hex / BLAKE2b keys, then the hash, vocabulary or managed
  id rule) gives the converted columns, and ``loader.gather.gather_block`` the ``CTRBatch`` (one
  batch per at most ``BATCH_ROWS`` rows, of exactly their number).
- the file route (``recsys_dist.serve.rows.score_rows``, ``kind == "file"``) otherwise, with
  the reason in ``reason``: a record written by another transform version or whose sizes,
  features or mapping differ from the config (the file route then reports the problem).

Errors: a value the request rules refuse raises the same ``BadRequest`` as the file route (the
same ``RowWriter`` checks, in the same row order). A request the conversion or the loader's
checks reject (a ``DataError``: a non-hex id, a non-integer, an hour that is no date, a
non-finite dense value) is scored again by the file route, which raises its ``BadRequest``
naming ``rows[i]`` and the column, word for word as before; only such requests pay its cost.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data import mapping as mp
from recsys_dist.data.convert.passes import Transform
from recsys_dist.data.formats.base import TRANSFORM_VERSION
from recsys_dist.data.loader import CTRBatch
from recsys_dist.data.loader.columns import Columns
from recsys_dist.data.loader.gather import gather_block
from recsys_dist.data.resolve import configured_sizes
from recsys_dist.errors import BadRequest, DataError
from recsys_dist.serve.export import LoadedModel
from recsys_dist.serve.rows import MAX_VALUE_CHARS, RowWriter, check_servable, outputs, score_rows
from recsys_dist.serve.scoring import scoring_format

log = logging.getLogger("recsys_dist.serve")

BATCH_ROWS = 4096  # rows per forward at most: predict's batch size (serve.export.score)
_NONE = type(None)


class FileScorer:
    """The file route (``score_rows``) for a model the in-memory route does not cover."""

    kind = "file"

    def __init__(self, loaded: LoadedModel, reason: str) -> None:
        self.loaded, self.reason = loaded, reason

    def __call__(self, rows: list) -> dict:
        return score_rows(self.loaded, rows)


def row_scorer(loaded: LoadedModel) -> InMemoryScorer | FileScorer:
    """How this model's requests are scored: :class:`InMemoryScorer`, or :class:`FileScorer`
    with the reason the in-memory route does not cover the model (logged as a warning)."""
    check_servable(loaded.job.fmt)  # before any fallback: neither route can score its rows
    try:
        reason = _uncovered(loaded)
        if reason is None:
            return InMemoryScorer(loaded)
    except Exception as err:  # noqa: BLE001 - any surprise here keeps the model served, by the file route
        reason = f"the in-memory route could not be set up ({str(err)[:300]})"
    log.warning("recsys-dist serve: %s is scored through files: %s", loaded.source, reason)
    return FileScorer(loaded, reason)


def _sizes(d, fmt, vocabs: list | None, managed: list[bool]) -> list[int]:
    """Table size per feature as the conversion makes them (``convert._Conversion``): the
    configured ones, a vocabulary's size in place of a vocabulary feature's."""
    sizes = configured_sizes(d, fmt)
    if vocabs is None:
        return sizes
    return [s if m else v.size for s, v, m in zip(sizes, vocabs, managed)]


def _uncovered(loaded: LoadedModel) -> str | None:
    """Why the in-memory route would not give the file route's inputs for this model, or None.
    (The checks the file route makes of a conversion, ``scoring.check_conversion``.)"""
    prep = loaded.preprocessing
    if prep is None:
        return "the model was loaded without its preprocessing record"
    d, fmt, r = loaded.job.data, loaded.job.fmt, prep.record
    if r.get("transform_version", TRANSFORM_VERSION) != TRANSFORM_VERSION:
        return f"its record's transform version {r['transform_version']} is not this recsys_dist's"
    if (
        r["format"] != fmt.name
        or list(r["dense"]) != list(fmt.dense_names)
        or list(r["sparse"]) != list(fmt.sparse_names)
    ):
        return "its record's format or features differ from its config"
    if r["categorical_mapping"]["kind"] != d.categorical_mapping:
        return "its record's categorical mapping differs from its config"
    for key in ("dense", "multi_hot"):
        if key in fmt.transforms and key in r["transforms"] and fmt.transforms[key] != r["transforms"][key]:
            return f"its record's {key} transform differs from this recsys_dist's"
    return None


class InMemoryScorer:
    """Scores request rows of one model without files (see the module doc). Thread-safe: a
    request uses only its own objects besides the model and the read-only vocabularies."""

    kind = "in-memory"
    reason = None

    def __init__(self, loaded: LoadedModel) -> None:
        job, f = loaded.job, loaded.job.features
        self.loaded, self.writer = loaded, RowWriter(job.fmt, loaded.preprocessing.record)
        self.layout = self.writer.layout
        self.fmt = self.layout.reader()
        self.managed = [n in f.managed or n in f.value_names for n in self.fmt.sparse_names]  # raw keys
        vocab = loaded.preprocessing.vocabulary
        self.vocabs = None if vocab is None else mp.load_vocabularies(vocab, list(self.fmt.sparse_names))
        self.sizes = _sizes(job.data, self.fmt, self.vocabs, self.managed)
        if self.sizes != loaded.preprocessing.num_embeddings:
            raise ValueError(f"table sizes {self.sizes} differ from its record's {loaded.preprocessing.num_embeddings}")
        self.dense_names, self.sparse_names, self.bounds = f.dense_names, f.keys, f.id_bounds
        self.label_columns = list(self.fmt.label_columns)
        self.tasks = (list(f.tasks), list(f.task_kinds))
        # e.g. user histories, computed while a file streams by: a format object of its own per request
        self.stateful = self.layout.stateful
        # characters a value may not hold (RowWriter._scalar): line breaks, the layout's unquoted ones
        self.forbidden = "[\n\r" + "".join(re.escape(c) for c in self.layout.forbidden) + "]"
        self.transform = Transform(self.fmt, self.sizes, self.vocabs, self.fmt.output_schema(), self.managed)

    def __call__(self, rows: list) -> dict:
        """Scores of ``rows`` (``recsys_dist.serve.rows`` describes them), as ``score_rows``
        returns them.

        Raises:
            BadRequest: a malformed row, naming ``rows[i]`` and the column.
        """
        try:
            if RowWriter.kind(rows) is dict:
                converted = self._convert(self._table(rows))
            else:
                converted = self._convert_lines(rows)
            return outputs(self._logits(converted), *self.tasks, len(rows))
        except DataError:
            return score_rows(self.loaded, rows)  # its own BadRequest, naming rows[i] and the column

    # ---------------------------------------------------------------- rows -> raw columns

    def _table(self, rows: list[dict]) -> pa.Table:
        """The rows' raw columns as text (the file route's values: ``RowWriter._record``)."""
        w = self.writer
        known = {*w.columns, *w.ignored, *w.unused}
        if any(not r.keys() <= known for r in rows):
            self._refuse(rows)
        cols = {c: self._column(rows, c) for c in w.columns}
        cols.update(self.layout.placeholders(len(rows)))  # e.g. a label the reader requires
        return pa.table(cols)

    def _column(self, rows: list[dict], c: str) -> pa.Array:
        """One column's values as text; the common kinds (text, integers, missing) without a
        Python call per value, the rest through ``RowWriter._value``."""
        w = self.writer
        vals = [r.get(c) for r in rows]
        kinds = set(map(type, vals))
        arr = None
        if c not in w.list_columns:
            try:
                if kinds <= {str, _NONE}:
                    arr = pc.fill_null(pa.array(vals, pa.string()), "")
                elif kinds <= {int, _NONE}:  # str(int), as RowWriter writes it
                    arr = pc.fill_null(pc.cast(pa.array(vals, pa.int64()), pa.string()), "")
            except (OverflowError, pa.ArrowException):
                arr = None  # an integer past int64: through RowWriter
        if arr is not None:
            if pc.any(pc.match_substring_regex(arr, self.forbidden)).as_py():
                self._refuse(rows)
            if (pc.max(pc.utf8_length(arr)).as_py() or 0) > MAX_VALUE_CHARS:  # RowWriter's limit
                self._refuse(rows)
            return arr
        try:
            texts = [w._value(i, c, v) for i, v in enumerate(vals)]
        except BadRequest:
            self._refuse(rows)
        if c in w.list_columns and w.parquet:
            return pa.array(texts, pa.list_(pa.string()))
        return pa.array([w.joined(c, t) for t in texts], pa.string())

    def _refuse(self, rows: list[dict]) -> None:
        """Raise the file route's first error, in row order (``RowWriter._record``)."""
        for i, r in enumerate(rows):
            self.writer._record(i, r)
        raise AssertionError("a row refused in memory passed RowWriter's checks")

    # ---------------------------------------------------------------- raw columns -> ids

    def _convert(self, table: pa.Table, fmt=None, path: str | None = None) -> list[pa.RecordBatch]:
        """The conversion's transform (``passes.Transform``) of the raw ``table``, block by block
        (``passes.Reader.batches``); ``fmt``: another format than the model's (text lines)."""
        transform = self.transform
        if fmt is not None or self.stateful:
            fmt = fmt or self.layout.reader()
            transform = Transform(fmt, self.sizes, self.vocabs, fmt.output_schema(), self.managed)
        if path is None:
            path = "rows.parquet" if self.writer.parquet else "rows.csv"
        out, kept = [], 0
        for batch in table.combine_chunks().to_batches():
            if batch.num_rows:
                out.append(transform(batch, path, kept)[0])
            kept += batch.num_rows
        return out

    def _convert_lines(self, rows: list[str]) -> list[pa.RecordBatch]:
        """Text lines read by the format's own reader (``read_chunks``) from a temporary file, as
        ``predict`` reads a file, then converted as :meth:`_convert`."""
        tmp = Path(tempfile.mkdtemp(prefix="recsys-serve-"))
        try:
            path = self.writer.write(rows, tmp)
            fmt = scoring_format(self.loaded.job.data, path)
            tables = [t for _, t in fmt.read_chunks(str(path))]
            return self._convert(pa.concat_tables(tables), fmt, str(path))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # ---------------------------------------------------------------- ids -> batch -> logits

    def _columns(self, batch: pa.RecordBatch) -> Columns:
        """A converted block as the loader's numpy columns (``loader.stream.read_window``), with
        its checks: ids within the tables, finite dense values (else DataError)."""
        n = batch.num_rows
        labels = [batch.column(c).to_numpy(zero_copy_only=False) for c in self.label_columns]
        labels = labels[0] if len(labels) == 1 else np.stack(labels, axis=1)
        dense = np.empty((n, len(self.dense_names)), np.float32)
        for j, name in enumerate(self.dense_names):
            dense[:, j] = batch.column(name).to_numpy(zero_copy_only=False)
        if not np.isfinite(dense).all():
            raise DataError("a dense value is not finite")
        ids = []
        for name, bound in zip(self.sparse_names, self.bounds):
            col = batch.column(name)
            if pa.types.is_list(col.type):
                values = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
                lengths = col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                ids.append((lengths, values))
            else:
                values = col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
                ids.append(values)
            if values.size and (values.min() < 0 or values.max() >= bound):
                raise DataError(f"column {name}: an id outside [0, {bound})")
        return Columns(labels.astype(np.float32, copy=False), dense, ids)

    @torch.no_grad()
    def _logits(self, converted: list[pa.RecordBatch]) -> np.ndarray:
        """The model's logits of every converted row, in order: float32 [N] (or [N, T])."""
        cols = [self._columns(b) for b in converted]
        cols = cols[0] if len(cols) == 1 else Columns.concat(cols)
        K = len(self.sparse_names)
        n_onehot = sum(not isinstance(c, tuple) for c in cols.ids)
        logits = []
        for lo in range(0, len(cols), BATCH_ROWS):
            B = min(BATCH_ROWS, len(cols) - lo)
            ones = torch.ones(B * K, dtype=torch.int32)
            dense, labels, sparse, _ = gather_block(cols, np.arange(lo, lo + B), B, n_onehot, ones, False)
            values, lengths = sparse[0] if isinstance(sparse, list) else (sparse[0], ones)
            batch = CTRBatch(
                dense_features=dense[0],
                sparse_features=KeyedJaggedTensor(keys=self.sparse_names, values=values, lengths=lengths, stride=B),
                labels=labels[0],
                weights=torch.ones(B, dtype=torch.float32),
            )
            _, (_, lg, _, _) = self.loaded.model(batch)
            logits.append(lg)
        return torch.cat(logits).numpy()
