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
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa


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
