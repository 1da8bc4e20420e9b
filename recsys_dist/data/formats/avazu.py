"""Avazu CTR CSV (Kaggle 2014/15 ``train.csv``) -> Parquet.

Raw layout: ``id,click,hour,C1,banner_pos,site_id,...,C21`` comma-separated, a header line
optional (it is detected). ``id`` overflows int64 and is never parsed. Transforms:

- label: ``click`` in {0, 1} -> float32.
- categorical: the 21 raw columns ``C1 .. C21`` as strings, plus ``hour_of_day`` (``HH``
  of ``hour`` = YYMMDDHH) and ``weekday`` (0 = Monday) derived from ``hour``: 23 features.
  Each value's UTF-8 bytes are hashed with BLAKE2b (8 bytes, little-endian, unsigned) and
  mapped to ``1 + h mod (num_embeddings - 1)``; an empty value maps to 0 (reserved).
- no dense features.

Hashing is vectorised per distinct value of a chunk (``dictionary_encode``), so Python
work grows with the number of distinct values, not with rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_dist.data import mapping
from recsys_dist.data.formats.base import RequestLayout, Rows, register_format, write_delimited
from recsys_dist.data.mapping import SparseKeys, text_keys
from recsys_dist.data.text import count_rows, line_blocks, parse_block, read_head, rows_then_bad_line
from recsys_dist.errors import DataError

RAW_COLUMNS = [
    "id",
    "click",
    "hour",
    "C1",
    "banner_pos",
    "site_id",
    "site_domain",
    "site_category",
    "app_id",
    "app_domain",
    "app_category",
    "device_id",
    "device_ip",
    "device_model",
    "device_type",
    "device_conn_type",
    "C14",
    "C15",
    "C16",
    "C17",
    "C18",
    "C19",
    "C20",
    "C21",
]
CATEGORICAL = RAW_COLUMNS[3:]
SPARSE_NAMES = CATEGORICAL + ["hour_of_day", "weekday"]


def hash_ids(col: pa.Array, num_embeddings: int) -> np.ndarray:
    """Strings -> int64 ids ``1 + blake2b64(value) mod (num_embeddings - 1)``; "" / null -> 0."""
    keys, present = text_keys(col)
    ids = mapping.hash_ids(keys, num_embeddings)
    ids[~present] = 0
    return ids


def _has_header(path: str) -> bool:
    return read_head(path, 3) == b"id,"  # a byte order mark before it is dropped


def _hours(hour: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """``hour`` (YYMMDDHH text) -> (valid [N]: 8 digits naming a real date and hour, the
    timestamps (null where not valid))."""
    digits = pc.match_substring_regex(pc.fill_null(hour, ""), r"^[0-9]{8}$")
    text = pc.binary_join_element_wise("20", pc.if_else(digits, hour, "00010100"), "")
    ts = pc.strptime(text, format="%Y%m%d%H", unit="s", error_is_null=True)
    # strptime normalises some impossible dates (Feb 30 -> Mar 2): they must print back the same.
    same = pc.equal(pc.strftime(ts, format="%Y%m%d%H"), text)
    valid = pc.and_(digits, pc.fill_null(same, False)).to_numpy(zero_copy_only=False)
    return valid, ts


class AvazuFormat:
    """Avazu CTR CSV: id, click, hour, C1 .. C21; see the module doc."""

    name = fingerprint = "avazu_csv"
    raw_columns = RAW_COLUMNS
    label_column = "click"
    label_columns = ["label"]
    weight_column = None
    task_names, task_kinds = ["label"], ["binary"]
    dense_names: list[str] = []
    sparse_names = SPARSE_NAMES
    sequence_names: list[str] = []
    spec = None
    transforms = {
        "label": "click as float32",
        "sparse": "id = 1 + blake2b64(utf8 value) mod (num_embeddings - 1) as int64; empty -> 0; "
        "hour_of_day = HH of hour, weekday = day of week of 20YYMMDD (0 = Monday), hashed the same way",
        "key": "blake2b64 of the value's UTF-8 bytes",
    }

    @staticmethod
    def count_rows(path: str | os.PathLike) -> int:
        return count_rows(path) - _has_header(str(path))

    @staticmethod
    def read_chunks(
        path: str, skipped: list | None = None, max_rows: int | None = None
    ) -> Iterator[tuple[int, pa.Table]]:
        header = _has_header(path)
        line, first = 1, True
        for chunk in line_blocks(path, None if max_rows is None else max_rows + header):
            parse = partial(
                parse_block,
                chunk,
                path,
                line,
                RAW_COLUMNS,
                delimiter=",",
                header=first and header,
                skipped=skipped,
                describe=lambda row: (
                    f"expected {row.expected_columns} fields, "
                    f"got {row.actual_columns} (an Avazu row has 24 comma-separated fields)"
                ),
            )
            yield from rows_then_bad_line(line + (first and header), parse)
            first = False
            line += chunk.count(b"\n")

    @staticmethod
    def header_lines(path: str) -> int:
        """Lines before the first row: 1 with a header line, else 0."""
        return int(_has_header(path))

    @staticmethod
    def bad_row_mask(batch: pa.RecordBatch):
        label_ok = pc.match_substring_regex(batch.column("click"), r"^[01]$").to_numpy(zero_copy_only=False)
        hour_ok, _ = _hours(batch.column("hour"))
        bad = ~(label_ok & hour_ok)
        reasons = [
            f"column {'click' if not label_ok[i] else 'hour'}: "
            f"'{batch.column('click' if not label_ok[i] else 'hour')[int(i)].as_py()}'"
            for i in np.flatnonzero(bad)
        ]
        return bad, reasons

    @staticmethod
    def parse_batch(batch: pa.RecordBatch, path: str, first_row: int):
        """Raw batch -> (labels float32 [N], [] (no dense), :class:`SparseKeys` per feature).

        Raises:
            DataError: a click other than 0/1, an hour that is not a YYMMDDHH date and hour,
                naming the file line (``first_row`` counts data rows) and column.
        """
        bad, reasons = AvazuFormat.bad_row_mask(batch)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            col = "click" if reasons[0].startswith("column click") else "hour"
            line = first_row + i + int(_has_header(path))
            raise DataError(
                f"{path}, line {line}, {reasons[0]} ("
                f"{'0 or 1' if col == 'click' else 'YYMMDDHH, a real date and hour'} expected)"
            )
        hour = batch.column("hour")
        hh = pc.utf8_slice_codeunits(hour, 6, 8)
        _, ts = _hours(hour)
        days = ts.cast(pa.int64()).to_numpy(zero_copy_only=False) // 86400
        weekday = pa.array(((days + 3) % 7).astype(str))  # 1970-01-01 was a Thursday
        columns = {c: batch.column(c) for c in CATEGORICAL}
        columns.update(hour_of_day=hh, weekday=weekday)
        labels = pc.cast(batch.column("click"), pa.float32()).to_numpy(zero_copy_only=False)
        return labels, [], [SparseKeys(*text_keys(columns[n])) for n in SPARSE_NAMES]

    @staticmethod
    def weights(batch: pa.RecordBatch, path: str, first_row: int) -> np.ndarray:
        """Never called: ``weight_column`` is None (no sample weights in avazu_csv)."""
        raise NotImplementedError("avazu_csv has no sample-weight column")

    @staticmethod
    def output_schema() -> pa.Schema:
        return pa.schema([pa.field("label", pa.float32())] + [pa.field(n, pa.int64()) for n in SPARSE_NAMES])

    @staticmethod
    def unlabelled(path: str | os.PathLike) -> None:
        """None: Avazu files are scored with their click column."""
        return None

    def request_layout(self) -> RequestLayout:
        """Request rows: the raw columns (``id`` and ``click`` optional, ignored); a text line as
        in ``train.csv`` (24 comma-separated fields). Written with a header line and placeholders
        ``id`` (its value, or "0") and ``click`` "0" (no unlabelled layout). A value may not hold
        a comma (no quoting)."""
        return RequestLayout(
            columns=list(RAW_COLUMNS),
            forbidden={",": "a comma"},
            placeholder_values={"id": "0", "click": "0"},
            write=_write_rows,
            reader=lambda: self,  # reads no state
            stateful=False,
        )


def _write_rows(rows: Rows, directory: Path) -> tuple[Path, int]:
    """``RequestLayout.write``: objects with the placeholders, as lines of ``train.csv``."""
    if rows and isinstance(rows[0], dict):
        rows = [{**r, "id": r["id"] or "0", "click": "0"} for r in rows]
    return write_delimited(rows, directory, name="rows.csv", columns=RAW_COLUMNS, delimiter=",", header=True)


AVAZU = AvazuFormat()


@register_format("avazu_csv")
def _avazu(schema, short_lines: str = "error") -> AvazuFormat:
    return AVAZU
