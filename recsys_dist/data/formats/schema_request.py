"""The ``schema`` format's request side (``SchemaFormat.request_layout``, a ``RequestLayout``).

Request rows hold the configured columns (label and weight optional, ignored); a multi-hot or
sequence value may be a JSON list. Rows given as text lines need ``data.schema.columns`` (their
field order) and a text ``file_type``. Objects are written as CSV with the configured delimiter
and quoting (``rows.csv``, a header line when ``data.schema.header``; in ``data.schema.columns``
order when given, the label left out), a list value joined by its column's separator; or, for
``file_type: parquet``, as Parquet (lists kept as lists). The unlabelled variant of the format
reads them back (the rows carry no label).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from recsys_dist.data.formats.base import RawFormat, RequestLayout, Rows
from recsys_dist.data.formats.history import history_columns, is_parquet

PARQUET_LINES = (
    "rows: this model reads Parquet (data.schema.file_type: parquet), so its rows have no text line; "
    "give each row as an object of column -> value"
)
UNNAMED_LINES = (
    "rows: this model's data.schema names no columns (its files carry a header line), so a text "
    "line's field order is unknown; give each row as an object of column -> value"
)


def schema_layout(spec, reader: Callable[[], RawFormat]) -> RequestLayout:
    """The request layout of a ``data.schema`` section (``spec``, a ``SchemaConfig``); ``reader``
    makes the format object that reads the rows in memory (the unlabelled variant)."""
    parquet = is_parquet(spec, "rows.csv")
    ignored = list(spec.label_columns())
    list_columns = frozenset({*spec.multi_hot, *(spec.sequence or {})})
    history = history_columns(spec.history) if spec.history else []
    cols = [
        *([spec.weight] if spec.weight else []),
        *spec.dense,
        *spec.categorical,
        *spec.multi_hot,
        *(spec.sequence or {}),
        *history,
    ]
    columns = list(dict.fromkeys(cols))
    return RequestLayout(
        columns=columns,
        write=partial(_write, spec, columns, ignored, parquet),
        reader=reader,
        ignored=ignored,
        list_columns=list_columns,
        parquet=parquet,
        lines_refused=PARQUET_LINES if parquet else None if spec.columns else UNNAMED_LINES,
        stateful=spec.history is not None,
        join=partial(_join, spec),
    )


def _join(spec, column: str, values: list[str]) -> str:
    """A multi-hot or sequence column's elements as one text field, joined by its separator."""
    seq = spec.sequence or {}
    return (seq[column].separator if column in seq else spec.separator).join(values)


def _write(spec, columns: list[str], ignored: list[str], parquet: bool, rows: Rows, directory: Path):
    """``RequestLayout.write`` (see the module doc): ``(path, header_lines)``."""
    if rows and isinstance(rows[0], str):
        return _write_lines(spec, ignored, rows, Path(directory))
    if parquet:
        path = Path(directory) / "rows.parquet"
        lists = {*spec.multi_hot, *(spec.sequence or {})}
        types = {c: pa.list_(pa.string()) if c in lists else pa.string() for c in columns}
        pq.write_table(pa.table({c: pa.array([r[c] for r in rows], types[c]) for c in columns}), path)
        return path, 0
    if spec.columns:  # the configured field order, label left out (kept where it is the history's action)
        columns = [c for c in spec.columns if c not in ignored or c in columns]
    header_lines = 1 if spec.header else 0
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=spec.delimiter, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    if header_lines:
        w.writerow(columns)
    for r in rows:
        w.writerow([_cell(spec, c, r.get(c, "")) for c in columns])
    path = Path(directory) / "rows.csv"
    path.write_text(buf.getvalue())
    return path, header_lines


def _cell(spec, column: str, value):
    return _join(spec, column, value) if isinstance(value, list) else value


def _write_lines(spec, ignored: list[str], rows: list[str], directory: Path) -> tuple[Path, int]:
    """Text lines as sent; with ``data.schema.header`` after a header line naming the fields
    (the label among them when the first line has as many fields as ``data.schema.columns``)."""
    text = "\n".join(r.rstrip("\r\n") for r in rows) + "\n"
    header_lines = 0
    if spec.header:
        fields = next(csv.reader([rows[0]], delimiter=spec.delimiter))
        full = len(fields) == len(spec.columns)  # with the label, else without it
        names = [c for c in spec.columns if full or c not in ignored]
        text = spec.delimiter.join(names) + "\n" + text
        header_lines = 1
    path = directory / "rows.csv"
    path.write_text(text)
    return path, header_lines
