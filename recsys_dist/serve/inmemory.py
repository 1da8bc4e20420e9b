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
  quoting as ``predict`` reads them). Then ``recsys_dist.data.encode.Encoder``, the encoding the
  training conversion and the loader use, makes the batches: the conversion's transform (the
  format's ``parse_batch``, its dense transform and hex / BLAKE2b keys, then the hash, vocabulary
  or managed id rule), the loader's checks and batch layout (one ``CTRBatch`` per at most
  ``BATCH_ROWS`` rows, of exactly their number).
- the file route (``recsys_dist.serve.request_rows.score_rows``, ``kind == "file"``) otherwise, with
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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from recsys_dist.data import encode
from recsys_dist.errors import BadRequest, DataError
from recsys_dist.serve.export import LoadedModel
from recsys_dist.serve.request_rows import MAX_VALUE_CHARS, RowWriter, check_servable, outputs, request_job, score_rows
from recsys_dist.serve.score_inputs import scoring_format

log = logging.getLogger("recsys_dist.serve")

BATCH_ROWS = encode.BATCH_ROWS  # rows per forward at most: predict's batch size (serve.export.score)
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


def _uncovered(loaded: LoadedModel) -> str | None:
    """Why the in-memory route would not give the file route's inputs for this model, or None.
    (The checks the file route makes of a conversion, ``score_inputs.check_conversion``.)"""
    prep = loaded.preprocessing
    if prep is None:
        return "the model was loaded without its preprocessing record"
    d, fmt, r = loaded.job.data, loaded.job.fmt, prep.record
    if r.get("transform_version", encode.TRANSFORM_VERSION) != encode.TRANSFORM_VERSION:
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
        self.job = job = request_job(loaded.job)  # a request's candidates never see each other
        f = job.features
        self.loaded, self.writer = loaded, RowWriter(job.fmt, loaded.preprocessing.record)
        self.layout = layout = self.writer.layout
        prep = loaded.preprocessing
        self.encoder = encode.Encoder(layout.reader, job.data, f, prep.vocabulary, BATCH_ROWS, layout.stateful)
        if self.encoder.sizes != prep.num_embeddings:
            raise ValueError(f"table sizes {self.encoder.sizes} differ from its record's {prep.num_embeddings}")
        self.tasks = (list(f.tasks), list(f.task_kinds))
        # characters a value may not hold (RowWriter._scalar): line breaks, the layout's unquoted ones
        self.forbidden = "[\n\r" + "".join(re.escape(c) for c in self.layout.forbidden) + "]"
        # the file the rows stand for (errors name it; a schema format reads a .parquet name as Parquet)
        self.path = "rows.parquet" if self.writer.parquet else "rows.csv"

    def __call__(self, rows: list) -> dict:
        """Scores of ``rows`` (``recsys_dist.serve.request_rows`` describes them), as ``score_rows``
        returns them.

        Raises:
            BadRequest: a malformed row, naming ``rows[i]`` and the column.
        """
        try:
            if RowWriter.kind(rows) is dict:
                batches = self.encoder.encode(self._table(rows), self.path)
            else:
                batches = self._encode_lines(rows)
            return outputs(self._logits(batches), *self.tasks, len(rows))
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

    # ---------------------------------------------------------------- text lines -> batches -> logits

    def _encode_lines(self, rows: list[str]) -> Iterator[encode.CTRBatch]:
        """Text lines read by the format's own reader (``read_chunks``) from a temporary file, as
        ``predict`` reads a file, then encoded (``Encoder.encode``)."""
        tmp = Path(tempfile.mkdtemp(prefix="recsys-serve-"))
        try:
            path = self.writer.write(rows, tmp)
            fmt = scoring_format(self.job.data, path)
            tables = [t for _, t in fmt.read_chunks(str(path))]
            return self.encoder.encode(pa.concat_tables(tables), str(path), fmt)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @torch.no_grad()
    def _logits(self, batches: Iterator[encode.CTRBatch]) -> np.ndarray:
        """The model's logits of every batch's rows, in order: float32 [N] (or [N, T])."""
        logits = []
        for batch in batches:
            _, (_, lg, _, _) = self.loaded.model(batch)
            logits.append(lg)
        return torch.cat(logits).numpy()
