"""JSON rows of a scoring request -> a raw file in the model's format -> scores.

A request's rows are scored through exactly the conversion ``recsys-dist predict`` applies
to a file (``recsys_dist.serve.export.score``): they are written as a raw file of the model's
format in a temporary directory (its own conversion cache, removed afterwards), so ids,
dense transforms and the vocabulary are those of the export by construction, never a
second implementation of them.

A row is either an object (raw column name -> value) or a raw text line of the format. Which
columns a row may hold (the ones the model reads, and ones it ignores such as labels), which
may be JSON lists, which characters a value may not hold and how the rows are written is the
format's request side (``RawFormat.request_layout()``, a ``data.formats.base.RequestLayout``;
each shipped format's ``request_layout`` describes its rows).

A missing column, ``null`` or ``""`` is a missing value. Rows are numbered from 0 in errors
(``rows[3]``). A column of the training file that the model does not use (its record's
``raw_columns``, e.g. a timestamp) is accepted and ignored, as ``predict`` ignores it in a file.

An id (a value of a column keyed by its text, ``recsys_dist.data.formats.ids``) is a string, or
an integer (written as its decimal text); a JSON float only when it is integral, below 2^53, and
the column's training values were all integers (the record's ``integer_columns``): it then maps
to the integer's id. Any other float, a boolean, a list (outside a list column) or an object is
a ``BadRequest`` naming the row and the column.

A request's rows of one user at one time (its candidates) never see each other, whatever
``data.schema.history.ties`` (:func:`request_job`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from recsys_dist.data.formats.base import RawFormat
from recsys_dist.data.formats.ids import id_columns
from recsys_dist.data.resolve import data_format
from recsys_dist.errors import BadRequest, ConfigError, DataError
from recsys_dist.serve.export import LoadedModel, score

MAX_ROWS = 100_000  # per request: a larger body is refused (HTTP 400) before anything is converted
MAX_LIST_ELEMENTS = 10_000  # per list value (multi-hot, sequence): a longer one is a 400
MAX_VALUE_CHARS = 4096  # per value (a list element each): a longer one is a 400
# per text line (a row given as one, or written to the file route's file): a longer one is a 400. Below
# pyarrow's CSV block (1 MiB, 4 bytes a character at most), which a line must not straddle
MAX_LINE_CHARS = 200_000


def request_job(job):
    """``job`` (a ``Job``) as a request's rows are read: under ``data.schema.history.ties:
    file_order`` with ties excluded instead (a new format object), else ``job`` itself.

    Why: file_order lets a row read the earlier rows of its user's time in file order, the
    training log's rule; a request's candidates share one time and must not read each other
    (each is scored as if sent alone, in any order). A candidate's history -- every strictly
    earlier event of its user, the last ``max_length`` -- is the same under either rule; only
    the histories of past events sharing a time (their own scores) lose those ties."""
    schema = job.data.schema
    h = schema.history if schema is not None else None
    if h is None or h.ties == "exclude":
        return job
    schema = schema.model_copy(update={"history": h.model_copy(update={"ties": "exclude"})})
    data = job.data.model_copy(update={"schema_": schema})
    return dataclasses.replace(job, data=data, fmt=data_format(data))


def _sigmoid(logit: np.ndarray) -> np.ndarray:
    """float32 probabilities as ``recsys-dist predict`` writes them (float64 sigmoid, cast)."""
    return (1.0 / (1.0 + np.exp(-logit.astype(np.float64)))).astype(np.float32)


class RowWriter:
    """Writes request rows as a raw file of one model's format (``write``), and names which
    data line of that file is which request row (``header_lines``)."""

    def __init__(self, fmt: RawFormat, record: dict | None = None) -> None:
        check_servable(fmt)
        """``fmt``: the model's format object (``job.fmt``), whose ``request_layout()`` says how
        rows become its raw input; ``record``: its preprocessing record (``preprocessing.json``):
        its ``raw_columns`` and ``integer_columns`` (None: not known, as for a record written
        before they were kept)."""
        self.format = fmt.name
        self.layout = layout = fmt.request_layout()
        self.columns, self.ignored, self.list_columns = list(layout.columns), list(layout.ignored), layout.list_columns
        self.parquet = layout.parquet
        self.header_lines = 0
        self.ids = {c.name for c in id_columns(fmt.name, fmt.spec)}
        record = record or {}
        known = record.get("integer_columns")
        self.integer_columns = None if known is None else set(known)
        # columns of the training file the model does not read: accepted, never written
        self.unused = [c for c in record.get("raw_columns") or [] if c not in self.columns and c not in self.ignored]

    def _known(self) -> str:
        if self.layout.listing is not None:
            return self.layout.listing
        unused = f" (read and ignored: {', '.join(self.unused)})" if self.unused else ""
        return ", ".join([*self.ignored, *self.columns]) + unused

    def known(self, column: str) -> bool:
        """Whether a request row may hold ``column`` (used, ignored, or unused by the model)."""
        return column in self.columns or column in self.ignored or column in self.unused

    def _value(self, i: int, column: str, v) -> str | list[str]:
        if v is None:
            return ""
        if isinstance(v, list) and column in self.list_columns:
            if len(v) > MAX_LIST_ELEMENTS:
                raise BadRequest(
                    f"rows[{i}], column {column}: a list of {len(v):,} elements, over the limit of "
                    f"{MAX_LIST_ELEMENTS:,} per list value; send the ids the model reads"
                )
            return [self._scalar(i, column, x, element=True) for x in v]
        return self._scalar(i, column, v)

    def _scalar(self, i: int, column: str, v, element: bool = False) -> str:
        """One value (list element) as the text a raw file would hold."""
        if v is None:
            return ""
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            what = "a list element" if element else "a value"
            raise BadRequest(
                f"rows[{i}], column {column}: {json_type(v)} is not {what} (give a string, a number or null"
                + (", or a list of them" if column in self.list_columns and not element else "")
                + ")"
            )
        if isinstance(v, float) and not math.isfinite(v):
            raise BadRequest(f"rows[{i}], column {column}: {v} is not a finite number")
        if isinstance(v, float) and column in self.ids:
            v = self._float_id(i, column, v)
        text = v if isinstance(v, str) else repr(v) if isinstance(v, float) else str(v)
        if len(text) > MAX_VALUE_CHARS:
            raise BadRequest(
                f"rows[{i}], column {column}: a value of {len(text):,} characters, over the limit of "
                f"{MAX_VALUE_CHARS:,} per value"
            )
        if "\n" in text or "\r" in text:
            raise BadRequest(f"rows[{i}], column {column}: a value may not hold a line break or a tab")
        for char, name in self.layout.forbidden.items():  # the file does not quote it: it would split the field
            if char in text:
                raise BadRequest(f"rows[{i}], column {column}: a value may not hold a line break or {name}")
        return text

    def _float_id(self, i: int, column: str, v: float) -> int:
        """A JSON float sent as an id: the integer it equals, where the column's training ids were
        all integers (their text is then the integer's); else ``BadRequest``."""
        where = f"rows[{i}], column {column}: {v!r}"
        if not v.is_integer():
            raise BadRequest(f"{where} is not an id; send an id as a string or an integer")
        if abs(v) > 2**53:
            raise BadRequest(
                f"{where} is past 2^53, where a float no longer holds every integer; send the id as an "
                "integer or a string"
            )
        if self.integer_columns is None:
            raise BadRequest(
                f"{where} is a float, and this model's preprocessing record does not say whether the column's "
                "training ids were integers (an export from before recsys_dist recorded it); send the id as an "
                "integer or a string, as the training data wrote it"
            )
        if column not in self.integer_columns:
            raise BadRequest(
                f"{where} is a float, and the column's training ids were not all integers, so it names no id for "
                "sure; send the id as a string, as the training data wrote it"
            )
        return int(v)

    def _record(self, i: int, row: dict) -> dict:
        unknown = [c for c in row if not self.known(c)]
        if unknown:
            raise BadRequest(
                f"rows[{i}]: unknown column {unknown[0]!r} for format {self.format} (its columns: {self._known()})"
            )
        return {c: self._value(i, c, row.get(c)) for c in self.columns}

    @staticmethod
    def kind(rows: list) -> type:
        """``dict`` when every row is an object, ``str`` when every row is a text line.

        Raises:
            BadRequest: a row that is neither, or a mix of both.
        """
        kinds = {type(r) for r in rows}
        if not kinds <= {dict, str}:
            i, bad = next((i, r) for i, r in enumerate(rows) if not isinstance(r, (dict, str)))
            raise BadRequest(
                f"rows[{i}]: {json_type(bad)}; a row is an object (column -> value) or a raw text line (a string)"
            )
        if len(kinds) > 1:
            raise BadRequest("rows: give every row as an object or every row as a text line, not a mix")
        return kinds.pop()

    def joined(self, column: str, value):
        """A list column's value as one text field, elements joined by the column's separator (a
        multi-hot or sequence column of a text file); any other value as it is."""
        return self.layout.join(column, value) if isinstance(value, list) else value

    def write(self, rows: list, directory: Path) -> Path:
        """Write ``rows`` (all objects, or all text lines) into ``directory`` as the format's
        ``request_layout().write`` does; the file's path (``header_lines``: lines before its first row).

        Raises:
            BadRequest: a row that is neither, a mix of both, an unknown column, a value that
                is not a string / number / null (or list for a list column), text lines the
                format does not take, a line over ``MAX_LINE_CHARS``.
        """
        if self.kind(rows) is str:
            if self.layout.lines_refused:
                raise BadRequest(self.layout.lines_refused)
            for i, line in enumerate(rows):
                if "\n" in line.rstrip("\n") or "\r" in line.rstrip("\r\n"):
                    raise BadRequest(f"rows[{i}]: a text line may not hold a line break")
            _check_lines(rows)
            path, self.header_lines = self.layout.write(rows, directory)
            return path
        records = [self._record(i, r) for i, r in enumerate(rows)]
        path, self.header_lines = self.layout.write(records, directory)
        if not self.parquet:  # a line per row (no value holds a line break)
            _check_lines(path.read_text().split("\n")[self.header_lines : -1])
        return path


def check_servable(fmt: RawFormat) -> None:
    """Refuse a format with no request side (``RawFormat.request_layout``): it trains, but request
    rows cannot be made into its raw input.

    Raises:
        ConfigError: naming ``data.format`` and the fix.
    """
    if not callable(getattr(fmt, "request_layout", None)):
        raise ConfigError(
            f"data.format: {fmt.name} ({type(fmt).__name__}) has no request side, so its models cannot score "
            "request rows; give it a request_layout() (recsys_dist.data.formats.base.RequestLayout, docs/data.md), "
            "or score files with recsys-dist predict"
        )


def _check_lines(lines: list[str]) -> None:
    """Raise ``BadRequest`` naming the first of the rows' text ``lines`` (one per row, in order)
    over ``MAX_LINE_CHARS``: pyarrow's reader mis-splits a line past its block."""
    if max(map(len, lines), default=0) > MAX_LINE_CHARS:
        i = next(i for i, line in enumerate(lines) if len(line) > MAX_LINE_CHARS)
        raise BadRequest(
            f"rows[{i}]: a text line of {len(lines[i]):,} characters, over the limit of {MAX_LINE_CHARS:,} per row "
            f"(and {MAX_VALUE_CHARS:,} per value)"
        )


def json_type(v) -> str:
    """The JSON name of a decoded value's type, for messages."""
    if v is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(v), type(v).__name__)


def _rows_message(err: DataError, path: Path, header_lines: int) -> str:
    """A conversion error about the temporary file, told about the request's rows: the path
    dropped, ``line N`` as ``rows[i]``."""
    text = str(err).replace(f"{path}, ", "").replace(str(path), "rows")

    def row(m: re.Match) -> str:
        return f"rows[{int(m.group(1)) - 1 - header_lines}]"

    text = re.sub(r"\bline (\d+)", row, text)
    return re.sub(r"^column (\S+), (rows\[\d+\])", r"\2, column \1", text)  # the row first


def check_body(body) -> list:
    """The ``rows`` list of a decoded request body.

    Raises:
        BadRequest: not an object with a non-empty ``rows`` list of at most ``MAX_ROWS`` rows.
    """
    if not isinstance(body, dict) or "rows" not in body:
        raise BadRequest(f'the body must be a JSON object {{"rows": [row, ...]}}, got {json_type(body)}')
    unknown = [k for k in body if k != "rows"]
    if unknown:
        raise BadRequest(f'unknown key {unknown[0]!r} in the body; it holds only "rows"')
    rows = body["rows"]
    if not isinstance(rows, list) or not rows:
        got = "an empty list" if rows == [] else json_type(rows)
        raise BadRequest(f'"rows" must be a non-empty list of rows, got {got}')
    if len(rows) > MAX_ROWS:
        raise BadRequest(f'"rows": {len(rows)} rows; at most {MAX_ROWS} per request (split the batch)')
    return rows


def score_rows(loaded: LoadedModel, rows: list) -> dict:
    """Scores of request ``rows`` (see the module doc) by ``loaded``, as ``predict`` scores a file.

    Returns ``{"scores": [...], "logits": [...]}`` (float32 values as floats, one per row in
    order): probabilities for a binary task (a regression task's score is its prediction, the
    logit); with several tasks each is an object task name -> list.

    Raises:
        BadRequest: a malformed row, naming ``rows[i]`` and the column.
    """
    job = request_job(loaded.job)
    writer = RowWriter(job.fmt, loaded.preprocessing.record if loaded.preprocessing else None)
    tmp = Path(tempfile.mkdtemp(prefix="recsys-serve-"))
    try:
        path = writer.write(rows, tmp)
        # Its own conversion cache: one entry per request, removed with it.
        job = dataclasses.replace(job, data=job.data.model_copy(update={"cache_dir": str(tmp / "c")}))
        try:
            # rows as objects are read unlabelled (data.schema): a label column written with them is
            # data.schema.history.action's (the rating), never a label to check
            reader = writer.layout.reader() if job.fmt.spec is not None and writer.kind(rows) is dict else None
            s = score(job, loaded.model, path, preprocessing=loaded.preprocessing, reader=reader)
        except DataError as err:
            raise BadRequest(_rows_message(err, path, writer.header_lines)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return outputs(s["logit"], s["tasks"], s["kinds"], len(rows))


def outputs(logit: np.ndarray, names: list[str], kinds: list[str], n_rows: int) -> dict:
    """The answer's ``scores`` and ``logits`` (see :func:`score_rows`) of float32 logits [N] or
    [N, T] (tasks ``names`` of ``kinds``) for a request of ``n_rows`` rows.

    Raises:
        BadRequest: N is not ``n_rows`` (a text line holding several rows).
    """
    if len(logit) != n_rows:
        raise BadRequest(f"rows: {n_rows} rows gave {len(logit)} scores (a text line holding several rows?)")
    if logit.ndim == 1:
        return {"scores": _sigmoid(logit).tolist(), "logits": logit.tolist()}
    scores, logits = {}, {}
    for t, (name, kind) in enumerate(zip(names, kinds)):
        logits[name] = logit[:, t].tolist()
        scores[name] = _sigmoid(logit[:, t]).tolist() if kind == "binary" else logits[name]
    return {"scores": scores, "logits": logits}
