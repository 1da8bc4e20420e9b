"""A raw format of your own in one file: JSON lines, one object per line.

``data.format: jsonl_format:jsonl`` (this file on PYTHONPATH) with its columns in
``data.format_args`` (``label``, ``dense``, ``categorical``)::

    {"label": 0, "I1": 1, "I2": 5, "C1": "68fd1e64", "C2": "80e26c9b"}

A field that is absent or null is a missing value. The parsing (labels, the log1p of the dense
values, hashing the categorical values into ids) is the shipped ``schema`` format's, so this
file only reads the lines. The request side (``request_layout``) is the schema format's columns
with this format's writing: ``POST /score`` takes the same JSON objects (the label optional,
ignored), written as JSON lines with a placeholder label.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.formats.base import RequestLayout, Rows
from recsys_dist.data.formats.schema import SchemaFormat
from recsys_dist.errors import DataError

BLOCK_LINES = 65536


class JsonLinesFormat(SchemaFormat):
    """JSON lines read into the text columns the ``schema`` format parses."""

    name = "jsonl"

    def __init__(self, spec: SchemaConfig) -> None:
        super().__init__(spec)
        self.fingerprint = "jsonl:" + self.fingerprint
        self.raw_columns = self._columns()

    def count_rows(self, path: str | os.PathLike) -> int:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())

    def read_chunks(self, path: str, skipped: list | None = None, max_rows: int | None = None):
        """``(first line, table of text columns)`` per block of lines; a line that is not a
        JSON object is a DataError naming it (or, with ``skipped``, left out and counted)."""
        columns = self._columns()
        rows: list[list] = []
        first = line_no = 1
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if max_rows is not None and line_no > max_rows:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise ValueError("not a JSON object")
                except ValueError as err:
                    if skipped is None:
                        raise DataError(f"{path}, line {line_no}: {err}") from None
                    skipped.append((line_no, str(err)))
                    continue
                if not rows:
                    first = line_no
                rows.append([_text(obj.get(c)) for c in columns])
                if len(rows) == BLOCK_LINES:
                    yield first, _table(columns, rows)
                    rows = []
        if rows:
            yield first, _table(columns, rows)

    def unlabelled(self, path: str | os.PathLike) -> None:
        return None

    def request_layout(self) -> RequestLayout:
        """The schema format's request columns, written as JSON lines with the placeholder label
        "0" and read back by this format (labelled); rows come as objects only."""
        return dataclasses.replace(
            super().request_layout(),
            placeholder_values={self.spec.label: "0"},
            write=self._write_rows,
            reader=lambda: JsonLinesFormat(self.spec),
            lines_refused="rows: give each row as a JSON object (column -> value), not as a text line",
            parquet=False,
            stateful=False,
        )

    def _write_rows(self, rows: Rows, directory: Path) -> tuple[Path, int]:
        """``RequestLayout.write``: the rows as JSON lines, each with the placeholder label."""
        path = Path(directory) / "rows.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                if not isinstance(r, dict):  # never: text lines are refused (lines_refused)
                    raise TypeError("a JSON-lines request row is an object")
                f.write(json.dumps({**r, self.spec.label: "0"}) + "\n")
        return path, 0


def _text(value) -> str | None:
    return None if value is None else str(value)


def _table(columns: list[str], rows: list[list]) -> pa.Table:
    return pa.table({c: pa.array([r[i] for r in rows], pa.string()) for i, c in enumerate(columns)})


def jsonl(
    schema, short_lines: str = "error", *, label: str, dense: Sequence[str] = (), categorical: Sequence[str] = ()
) -> JsonLinesFormat:
    """The format object of ``data.format: jsonl_format:jsonl``; ``data.format_args`` names its
    columns."""
    if schema is not None:
        raise ValueError("data.schema: not used with jsonl_format:jsonl (name the columns in data.format_args)")
    return JsonLinesFormat(
        SchemaConfig.model_validate(
            {
                "label": label,
                "dense": list(dense),
                "categorical": list(categorical),
                "header": False,
                "columns": [label, *dense, *categorical],
            }
        )
    )
