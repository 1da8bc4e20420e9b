"""The raw-format interface (:class:`RawFormat`) and the format registry (:data:`FORMATS`).

A format reads a raw file as blocks of text columns, finds the rows its transforms reject,
and parses a block into labels, dense columns and categorical keys; ``recsys_dist.data.convert``
does the rest (splits, id mapping, Parquet, cache). A new format is one module in this package
with a factory decorated by :func:`register_format`; ``recsys_dist.data.resolve`` imports the
format modules, and ``data.format`` (``recsys_dist.data.config``) must list the same names
(tests/unit/data/test_formats.py checks it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_dist.errors import DataError


@runtime_checkable
class RawFormat(Protocol):
    """What the conversion, the config checks and scoring use of a format object.

    Names and columns (lists of str, in model order):
        name: the manifest's ``format`` (``criteo_tsv``, ``avazu_csv``, ``schema``, or an
            unlabelled variant ``<name>_unlabelled``).
        fingerprint: the format's part of the cache key (its name, plus every option that
            changes the converted output).
        raw_columns: the raw file's columns (None until a schema format has read a header).
        label_column: the raw column of the (first) label.
        label_columns: the converted Parquet's label columns (``["label"]``, or
            ``["label:<task>", ...]`` for several tasks); the loader reads them.
        weight_column: the converted sample-weight column, or None.
        task_names, task_kinds: one per label column; kinds ``binary`` / ``regression``.
        dense_names: dense features (float32 columns).
        sparse_names: categorical features (int64 or list<int64> columns), sequence ones last.
        sequence_names: the unpooled (sequence) features among ``sparse_names``.
        transforms: what each output column holds, as text for the manifest (``label``,
            ``dense``, ``sparse``, ``key``, ...).
        spec: the ``data.schema`` section of a schema format, else None.
    """

    name: str
    fingerprint: str
    raw_columns: list[str] | None
    label_column: str
    label_columns: list[str]
    weight_column: str | None
    task_names: list[str]
    task_kinds: list[str]
    dense_names: list[str]
    sparse_names: list[str]
    sequence_names: list[str]
    transforms: dict[str, str]
    spec: Any

    def count_rows(self, path: str | os.PathLike) -> int:
        """Data rows of the file (every line but a header; bad lines included).

        Raises:
            DataError: the file cannot be read.
        """
        ...

    def read_chunks(
        self, path: str, skipped: list | None = None, max_rows: int | None = None
    ) -> Iterator[tuple[int, pa.Table]]:
        """``(first file line, table of raw columns)`` per block, in file order; bad lines
        raise a DataError, or with ``skipped`` (a list) are appended as ``(line or None,
        reason)`` and left out. ``max_rows``: stop after that many data rows."""
        ...

    def bad_row_mask(self, batch: pa.RecordBatch) -> tuple[np.ndarray, list[str]]:
        """bool [N]: rows whose values the transforms reject; and a reason per bad row."""
        ...

    def parse_batch(self, batch: pa.RecordBatch, path: str, first_row: int) -> tuple[np.ndarray, list, list]:
        """(labels float32 [N] or [N, T], dense float32 [N] per dense feature, ``SparseKeys``
        per sparse feature). ``first_row``: 1-based data row of ``batch[0]``.

        Raises:
            DataError: a rejected value, naming the file, line and column.
        """
        ...

    def weights(self, batch: pa.RecordBatch, path: str, first_row: int) -> np.ndarray:
        """float32 [N] sample weights (only called when ``weight_column`` is set)."""
        ...

    def output_schema(self) -> pa.Schema:
        """The converted Parquet's schema: label column(s), dense, sparse, then the weight."""
        ...

    def unlabelled(self, path: str | os.PathLike) -> RawFormat | None:
        """The format that reads ``path`` with placeholder labels when the file has no label
        (scoring only), or None when it has them or the format has no unlabelled layout."""
        ...

    def request_layout(self) -> RequestLayout:
        """The request side: how rows of a scoring request (``POST /score``) become this
        format's raw input (:class:`RequestLayout`)."""
        ...


# A request's rows for RequestLayout.write: all objects (raw column -> text, a list of texts for a
# list column), or all raw text lines as sent.
Rows = list[dict[str, Any]] | list[str]


def typed_floats(col: pa.Array, where: str | None = None) -> np.ndarray:
    """float64 [N]: a typed (Parquet) column's values as numbers, null as NaN.

    Raises:
        DataError: the column's type holds no numbers (a timestamp, a date, bytes), naming ``where``
            (the file and column) and the fix; with ``where`` None every value is NaN instead (a
            check of bad rows: every row bad, then reported by the parse as this error).
    """
    try:
        return pc.cast(col, pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
    except pa.ArrowNotImplementedError:
        if where is None:
            return np.full(len(col), np.nan)
        raise DataError(
            f"{where}: holds {col.type} values, not numbers; write the column as numbers (a time as int64, e.g. "
            "seconds since the epoch)"
        ) from None


def refuse_list(spec, path: str, name: str, type_: pa.DataType) -> None:
    """Raise a DataError when the list column ``name`` (of type ``type_``) is one that
    ``data.schema`` (``spec``) reads one value per row from: a label, weight, dense or categorical
    column, or the history's user, item, time or action (only multi-hot and sequence columns hold
    lists; others are not read)."""
    h = getattr(spec, "history", None)
    one = {*spec.label_columns(), *([spec.weight] if spec.weight else []), *spec.dense, *spec.categorical}
    one |= {h.user, h.item, h.time, getattr(h, "action", None)} if h is not None else set()
    if name in one:
        raise DataError(
            f"{path}, column {name}: a list column ({type_}) where data.schema reads one value per row; only "
            "data.schema.multi_hot and sequence columns hold lists"
        )


def _no_join(column: str, values: list[str]) -> str:
    raise ValueError(f"column {column}: this format has no list columns")


@dataclass(frozen=True)
class RequestLayout:
    """The request side of a format (``RawFormat.request_layout()``): which columns a request row
    (a JSON object of raw column -> value, or a raw text line) may hold and how the rows become
    this format's raw input. ``recsys_dist.serve`` checks every value (type, length, line breaks,
    ``forbidden``), then writes the rows as a raw file (``write``, read back by the format's
    scoring reader, ``fmt.unlabelled(path) or fmt``), or builds a table of text columns
    ``columns`` plus :meth:`placeholders` that ``reader()`` converts in memory. Both routes must
    give the same model inputs.

    Fields:
        columns: the raw columns a row may give that the model reads, in table order.
        ignored: columns a row may hold that scoring ignores (labels, the sample weight).
        list_columns: columns whose value may be a JSON list of values (multi-hot, sequence).
        forbidden: characters (besides line breaks, which no value may hold) a value may not
            hold because the raw file does not quote them, each with its name for the message:
            ``{"\\t": "a tab"}`` for a tab-separated file.
        placeholder_values: constant text columns the in-memory table adds for ``reader()``
            (a label column it requires, ...).
        listing: how an unknown-column message lists the columns (None: ``ignored``, ``columns``).
        parquet: rows are written as Parquet (objects only; lists kept as lists).
        lines_refused: why rows given as text lines are refused (None: they are accepted).
        stateful: the reader keeps state while rows stream by (user histories): a new one per request.
        write: ``write(rows, directory) -> (path, header_lines)``: the rows (:data:`Rows`) as a
            raw file in ``directory``; ``header_lines``: lines before the first row.
        reader: ``reader() -> RawFormat``: the format object that reads the in-memory table (a new
            one per call where ``stateful``).
        join: ``join(column, texts) -> text``: a list column's elements as one text field.
    """

    columns: list[str]
    write: Callable[[Rows, Path], tuple[Path, int]]
    reader: Callable[[], RawFormat]
    ignored: list[str] = field(default_factory=list)
    list_columns: frozenset[str] = frozenset()
    forbidden: Mapping[str, str] = field(default_factory=dict)
    placeholder_values: Mapping[str, str] = field(default_factory=dict)
    listing: str | None = None
    parquet: bool = False
    lines_refused: str | None = None
    stateful: bool = True
    join: Callable[[str, list[str]], str] = _no_join

    def placeholders(self, n: int) -> dict[str, pa.Array]:
        """The ``placeholder_values`` as text columns of ``n`` rows."""
        return {c: pa.array([v] * n, pa.string()) for c, v in self.placeholder_values.items()}


def write_delimited(
    rows: Rows, directory: Path, *, name: str, columns: list[str], delimiter: str, header: bool
) -> tuple[Path, int]:
    """``RequestLayout.write`` of a delimited text layout that reads no quotes: objects as lines of
    ``columns`` (values as they are; a header line of the names with ``header``), text lines as
    sent, into ``directory / name``."""
    path = Path(directory) / name
    if rows and isinstance(rows[0], str):
        path.write_text("\n".join(r.rstrip("\r\n") for r in rows) + "\n")
        return path, 0
    lines = [delimiter.join(columns)] if header else []
    lines += [delimiter.join(r[c] for c in columns) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path, int(header)


# The version of every format's transforms (raw value -> model input): part of the conversion
# cache key and of the preprocessing record, so that a change to any transform invalidates both.
TRANSFORM_VERSION = 1

# A factory: (the data.schema section or None, data.short_lines, **data.format_args) -> the format object.
FormatFactory = Callable[..., RawFormat]

# data.format -> its factory; the one list of format names (filled by register_format).
FORMATS: dict[str, FormatFactory] = {}


def register_format(name: str) -> Callable[[FormatFactory], FormatFactory]:
    """Decorator: register ``factory(schema, short_lines, **format_args) -> RawFormat`` as
    ``data.format: name`` (``recsys_dist.register_format``). ``schema``: the ``data.schema``
    section or None; ``short_lines``: ``data.short_lines``; ``format_args``: ``data.format_args``,
    checked against the factory's keyword parameters. A format of your own may also be named by
    its factory's import path (``data.format: package.module:factory``), registered or not.

    Raises:
        ValueError: ``name`` is registered already, or is an import path.
    """
    if ":" in name:
        raise ValueError(f"register_format: {name!r} contains ':'; import paths need no registration")

    def register(factory: FormatFactory) -> FormatFactory:
        if name in FORMATS:
            raise ValueError(f"data.format {name!r} is registered twice")
        FORMATS[name] = factory
        return factory

    return register
