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
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recsys_dist.data import mapping
from recsys_dist.data.criteo import DataError, _BadRows, count_rows, line_blocks
from recsys_dist.data.mapping import SparseKeys, text_keys

RAW_COLUMNS = ["id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
               "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
               "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"]
CATEGORICAL = RAW_COLUMNS[3:]
SPARSE_NAMES = CATEGORICAL + ["hour_of_day", "weekday"]


def hash_ids(col: pa.Array, num_embeddings: int) -> np.ndarray:
    """Strings -> int64 ids ``1 + blake2b64(value) mod (num_embeddings - 1)``; "" / null -> 0."""
    keys, present = text_keys(col)
    ids = mapping.hash_ids(keys, num_embeddings)
    ids[~present] = 0
    return ids


def _has_header(path: str) -> bool:
    with pa.input_stream(path, compression="detect") as f:
        return f.read(3) == b"id,"


class AvazuFormat:
    name = "avazu_csv"
    raw_columns = RAW_COLUMNS
    dense_names: list[str] = []
    sparse_names = SPARSE_NAMES
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
    def read_chunks(path: str, skipped: list | None = None) -> Iterator[tuple[int, pa.Table]]:
        header = _has_header(path)
        line, first = 1, True
        for chunk in line_blocks(path):
            skip = 1 if (first and header) else 0
            bad = _BadRows()
            table = pacsv.read_csv(
                pa.py_buffer(chunk),
                read_options=pacsv.ReadOptions(column_names=RAW_COLUMNS, skip_rows=skip, use_threads=False),
                parse_options=pacsv.ParseOptions(quote_char=False, invalid_row_handler=bad),
                convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in RAW_COLUMNS},
                                                     strings_can_be_null=False),
            )
            if bad.rows:
                if skipped is None:
                    row = bad.rows[0]
                    n = None if row.number is None else row.number + line - 1
                    raise DataError(f"{path}, line {n}: expected {row.expected_columns} fields, got "
                                    f"{row.actual_columns} (an Avazu row has 24 comma-separated fields)")
                skipped += [(None, f"{r.actual_columns} fields, expected 24") for r in bad.rows]
            first = False
            yield line, table
            line += chunk.count(b"\n")

    @staticmethod
    def bad_row_mask(batch: pa.RecordBatch):
        label_ok = pc.match_substring_regex(batch.column("click"), r"^[01]$").to_numpy(zero_copy_only=False)
        hour_ok = pc.match_substring_regex(batch.column("hour"), r"^[0-9]{8}$").to_numpy(zero_copy_only=False)
        bad = ~(label_ok & hour_ok)
        reasons = [f"column {'click' if not label_ok[i] else 'hour'}" for i in np.flatnonzero(bad)]
        return bad, reasons

    @staticmethod
    def parse_batch(batch: pa.RecordBatch, path: str, first_row: int):
        """Raw batch -> (labels float32 [N], [] (no dense), :class:`SparseKeys` per feature)."""
        bad, reasons = AvazuFormat.bad_row_mask(batch)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            col = "click" if "click" in reasons[0] else "hour"
            raise DataError(f"{path}, data row {first_row + i}, {reasons[0]}: "
                            f"'{batch.column(col)[i].as_py()}' ({'0 or 1' if col == 'click' else 'YYMMDDHH'} expected)")
        hour = batch.column("hour")
        hh = pc.utf8_slice_codeunits(hour, 6, 8)
        days = pc.strptime(pc.binary_join_element_wise("20", pc.utf8_slice_codeunits(hour, 0, 6), ""),
                           format="%Y%m%d", unit="s").cast(pa.int64()).to_numpy(zero_copy_only=False) // 86400
        weekday = pa.array(((days + 3) % 7).astype(str))  # 1970-01-01 was a Thursday
        columns = {c: batch.column(c) for c in CATEGORICAL}
        columns.update(hour_of_day=hh, weekday=weekday)
        labels = pc.cast(batch.column("click"), pa.float32()).to_numpy(zero_copy_only=False)
        return labels, [], [SparseKeys(*text_keys(columns[n])) for n in SPARSE_NAMES]

    @staticmethod
    def output_schema() -> pa.Schema:
        return pa.schema([pa.field("label", pa.float32())] + [pa.field(n, pa.int64()) for n in SPARSE_NAMES])


AVAZU = AvazuFormat()
