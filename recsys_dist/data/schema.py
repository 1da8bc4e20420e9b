"""Any CSV / TSV / Parquet file described by ``data.schema`` in the config -> Parquet.

Columns are named in the schema (from the header line, from ``schema.columns``, or from the
Parquet file). Transforms:

- label: the ``label`` column as a number; with ``label_threshold`` t, label = 1 if value >= t
  else 0 (e.g. a rating >= 4 is a click); without it the value must be 0 or 1.
- ``dense``: numbers (empty -> 0) as float32, ``log1p(max(x, 0))`` or unchanged
  (``dense_transform: none``); a value that is not a finite number is an error.
- ``categorical``: one value per row, as text (Parquet numbers are written as text), hashed
  or looked up in the vocabulary (``recsys_dist.data.mapping``); empty -> 0.
- ``multi_hot``: a text list split on ``separator`` (``"a|b|c"``), or a Parquet list column;
  each element mapped like a categorical value; empty elements are dropped, an empty field
  is an empty bag. Stored as ``list<int64>``.

CSV is read in blocks cut at line ends (``criteo.line_blocks``), so a quoted field may hold
the delimiter but not a line break.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys_dist.data.criteo import DataError, _BadRows, count_rows, line_blocks
from recsys_dist.data.mapping import SparseKeys, text_keys


_NUMBER = r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"


def _is_parquet(spec, path: str) -> bool:
    return spec.file_type == "parquet" or (spec.file_type == "auto" and str(path).endswith((".parquet", ".pq")))


def _floats(col: pa.Array, where: str, first_line: int) -> np.ndarray:
    """Text -> float64 (empty -> NaN). Raises DataError naming the line of a bad value."""
    col = pc.fill_null(col, "") if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) else col
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return pc.cast(col, pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
    text = pc.utf8_trim_whitespace(col)
    try:
        return pc.cast(pc.if_else(pc.equal(text, ""), None, text), pa.float64()).fill_null(np.nan) \
            .to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid:
        for i, v in enumerate(text.to_pylist()):
            try:
                float(v) if v else None
            except ValueError:
                raise DataError(f"{where}, line {first_line + i}: '{v}' is not a number") from None
        raise


class SchemaFormat:
    """A raw format from a ``data.schema`` section (a ``SchemaConfig``); see the module doc."""

    name = "schema"

    def __init__(self, spec) -> None:
        self.spec = spec
        self.dense_names = list(spec.dense)
        self.sparse_names = list(spec.categorical) + list(spec.multi_hot)
        self.fingerprint = "schema:" + json.dumps(spec.model_dump(mode="json") if hasattr(spec, "model_dump")
                                                  else vars(spec), sort_keys=True)
        label = f"1 if {spec.label} >= {spec.label_threshold} else 0" if spec.label_threshold is not None \
            else f"{spec.label} (0 or 1)"
        self.transforms = {
            "label": f"{label} as float32",
            "dense": ("log1p(max(x, 0))" if spec.dense_transform == "log1p" else "x") + " as float32; empty -> 0",
            "sparse": "id = 1 + blake2b64(utf8 value) mod (num_embeddings - 1) as int64; empty -> 0",
            "multi_hot": f"split on {spec.separator!r}, empty elements dropped, each element mapped like a "
                         "categorical value; list<int64>",
            "key": "blake2b64 of the value's UTF-8 text",
        }
        self.raw_columns: list[str] | None = None

    # ---------------------------------------------------------------- reading

    def _header(self, path: str) -> list[str]:
        s = self.spec
        if not s.header:
            if not s.columns:
                raise DataError(f"{path}: data.schema.header is false, so data.schema.columns must name every field")
            return list(s.columns)
        with pa.input_stream(path, compression="detect") as f:
            first = f.read(1 << 16).split(b"\n", 1)[0]
        if not first.strip():
            return list(s.columns or [])
        names = pacsv.read_csv(pa.py_buffer(first + b"\n"), read_options=pacsv.ReadOptions(autogenerate_column_names=True),
                               parse_options=pacsv.ParseOptions(delimiter=s.delimiter),
                               convert_options=pacsv.ConvertOptions(strings_can_be_null=False)).to_pylist()[0]
        return list(s.columns) if s.columns else [str(v).strip() for v in names.values()]

    def _check_columns(self, path: str, names: list[str], where: str) -> None:
        s = self.spec
        needed = [s.label, *s.dense, *s.categorical, *s.multi_hot]
        missing = [c for c in needed if c not in names]
        if missing:
            raise DataError(f"{path}: columns {missing} named in data.schema are not in the file ({where}: {names})")
        self.raw_columns = names

    def count_rows(self, path: str | os.PathLike) -> int:
        if _is_parquet(self.spec, str(path)):
            return pq.ParquetFile(str(path)).metadata.num_rows
        n = count_rows(path)
        return max(n - 1, 0) if self.spec.header else n

    def read_chunks(self, path: str, skipped: list | None = None) -> Iterator[tuple[int, pa.Table]]:
        """``(first line, table of text columns)`` per block; Parquet row groups are read as
        they are and numbers turned into text, lists into lists of text."""
        if _is_parquet(self.spec, path):
            yield from self._parquet_chunks(path)
            return
        names = self._header(path)
        self._check_columns(path, names, "header" if self.spec.header else "data.schema.columns")
        line, first = 1, True
        for chunk in line_blocks(path):
            skip = 1 if (first and self.spec.header) else 0
            bad = _BadRows()
            try:
                table = pacsv.read_csv(
                    pa.py_buffer(chunk),
                    read_options=pacsv.ReadOptions(column_names=names, skip_rows=skip, use_threads=True),
                    parse_options=pacsv.ParseOptions(delimiter=self.spec.delimiter, invalid_row_handler=bad),
                    convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in names},
                                                         strings_can_be_null=False),
                )
            except pa.ArrowInvalid as err:
                raise DataError(f"{path}, from line {line}: {err}") from None
            if bad.rows:
                if skipped is None:
                    row = bad.rows[0]
                    n = "a line" if row.number is None else f"line {row.number + line - 1}"
                    raise DataError(f"{path}, {n}: expected {row.expected_columns} fields, got {row.actual_columns} "
                                    f"(the columns are {names}, separated by {self.spec.delimiter!r})")
                skipped += [(None, f"{r.actual_columns} fields, expected {r.expected_columns}") for r in bad.rows]
            yield line + skip, table
            line += chunk.count(b"\n")
            first = False

    def _parquet_chunks(self, path: str) -> Iterator[tuple[int, pa.Table]]:
        try:
            f = pq.ParquetFile(path)
        except (OSError, pa.ArrowInvalid) as err:
            raise DataError(f"{path}: cannot read as Parquet ({err})") from None
        self._check_columns(path, f.schema_arrow.names, "Parquet schema")
        row = 1
        for batch in f.iter_batches(batch_size=65536):
            cols = {}
            for name, col in zip(batch.schema.names, batch.columns):
                if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                    cols[name] = pc.cast(col, pa.list_(pa.string()))
                elif name in self.spec.multi_hot or name in self.spec.categorical:
                    cols[name] = pc.cast(col, pa.string())
                else:
                    cols[name] = col
            yield row, pa.table(cols)
            row += batch.num_rows

    # ---------------------------------------------------------------- checking

    def _labels(self, batch: pa.RecordBatch, where: str, first_line: int) -> np.ndarray:
        s = self.spec
        x = _floats(batch.column(s.label), f"{where}, column {s.label}", first_line)
        bad = np.isnan(x) if s.label_threshold is not None else ~np.isin(x, (0.0, 1.0))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            want = "a number" if s.label_threshold is not None else "0 or 1 (or set data.schema.label_threshold)"
            raise DataError(f"{where}, line {first_line + i}, column {s.label}: "
                            f"'{batch.column(s.label)[i].as_py()}' is not {want}")
        return (x >= s.label_threshold if s.label_threshold is not None else x).astype(np.float32)

    def bad_row_mask(self, batch: pa.RecordBatch) -> tuple[np.ndarray, list[str]]:
        """Rows whose label or a dense value the transforms reject, and why (first reason per row)."""
        bad = np.zeros(batch.num_rows, dtype=bool)
        reason = np.full(batch.num_rows, None, dtype=object)
        s = self.spec
        label_pattern = _NUMBER if s.label_threshold is not None else r"^[01](\.0*)?$"
        for name, pattern, empty_ok in [(s.label, label_pattern, False)] + [(n, _NUMBER, True) for n in s.dense]:
            col = batch.column(name)
            if not pa.types.is_string(col.type):  # typed Parquet column
                x = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
                ok = np.isfinite(x) | (empty_ok & np.isnan(x))
                if name == s.label and s.label_threshold is None:
                    ok &= np.isin(x, (0.0, 1.0))
            else:
                text = pc.utf8_trim_whitespace(pc.fill_null(col, ""))
                ok = pc.match_substring_regex(text, pattern).to_numpy(zero_copy_only=False)
                if empty_ok:
                    ok |= pc.equal(text, "").to_numpy(zero_copy_only=False)
            new = ~ok & ~bad
            for i in np.flatnonzero(new)[:10]:
                reason[i] = f"column {name}: '{col[int(i)].as_py()}'"
            bad |= ~ok
        return bad, [r or "invalid value" for r in reason[bad]]

    # ---------------------------------------------------------------- transforming

    def parse_batch(self, batch: pa.RecordBatch, path: str, first_row: int):
        """Raw batch -> (labels float32 [N], dense float32 [N] per dense column,
        :class:`SparseKeys` per categorical then multi-hot column).

        Raises:
            DataError: a label or dense value that is not a (finite) number, naming the
                file, line (row for Parquet) and column.
        """
        s = self.spec
        first_line = first_row + (1 if s.header and not _is_parquet(s, path) else 0)
        labels = self._labels(batch, path, first_line)
        dense = []
        for n in s.dense:
            x = _floats(batch.column(n), f"{path}, column {n}", first_line)
            if np.isinf(x).any():
                i = int(np.flatnonzero(np.isinf(x))[0])
                raise DataError(f"{path}, line {first_line + i}, column {n}: {x[i]} is not finite")
            x = np.nan_to_num(x, nan=0.0)
            dense.append((np.log1p(np.maximum(x, 0.0)) if s.dense_transform == "log1p" else x).astype(np.float32))
        sparse = [SparseKeys(*text_keys(batch.column(n))) for n in s.categorical]
        for n in s.multi_hot:
            col = batch.column(n)
            lists = col if pa.types.is_list(col.type) else pc.split_pattern(pc.fill_null(col, ""), s.separator)
            flat = pc.utf8_trim_whitespace(pc.fill_null(pc.list_flatten(lists), ""))
            parent = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)
            keep = pc.not_equal(flat, "").to_numpy(zero_copy_only=False)
            keys, _ = text_keys(flat.filter(pa.array(keep)))
            lengths = np.bincount(parent[keep], minlength=batch.num_rows).astype(np.int32)
            sparse.append(SparseKeys(keys, None, lengths))
        return labels, dense, sparse

    def output_schema(self) -> pa.Schema:
        fields = [pa.field("label", pa.float32())]
        fields += [pa.field(n, pa.float32()) for n in self.dense_names]
        fields += [pa.field(n, pa.int64()) for n in self.spec.categorical]
        fields += [pa.field(n, pa.list_(pa.int64())) for n in self.spec.multi_hot]
        return pa.schema(fields)
