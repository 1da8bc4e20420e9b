"""Any CSV / TSV / Parquet file described by ``data.schema`` in the config -> Parquet.

Columns are named in the schema (from the header line, from ``schema.columns``, or from the
Parquet file). Transforms:

- label: the ``label`` column as a number; with ``label_threshold`` t, label = 1 if value >= t
  else 0 (e.g. a rating >= 4 is a click); without it the value must be 0 or 1.
- ``dense``: numbers (empty -> 0) as float32, ``log1p(max(x, 0))`` or unchanged
  (``dense_transform: none``); a value that is not a finite number is an error.
- ``categorical``: one value per row, as text (Parquet numbers are written as text), hashed
  or looked up in the vocabulary (``recsys_dist.data.mapping``); empty -> 0. The key of a
  value is the BLAKE2b-64 hash of its text, or, for a column listed in ``hex_categorical``,
  the value read as a hex number (at most 8 digits, Criteo's C1..C26), as ``criteo_tsv``
  reads it: the same rows then get the same ids by either route.
- ``multi_hot``: a text list split on ``separator`` (``"a|b|c"``), or a Parquet list column;
  each element mapped like a categorical value; empty elements are dropped, an empty field
  is an empty bag. Stored as ``list<int64>``.
- ``sequence``: an ordered list like a multi-hot column (split on the column's own
  separator), oldest first, truncated to its most recent ``max_length`` elements; a plain value
  is a list of one, an empty field an empty sequence. Stored as ``list<int64>``.
- ``history``: a derived sequence: per row, the items of the same user's rows whose time is
  strictly smaller, the most recent ``max_length`` of them (docs/data.md, 'Sequence features and user histories').

CSV is read in blocks cut at line ends (``data.text.line_blocks``): a quoted field may hold a delimiter, no line break.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys_dist.data.formats import history as hist
from recsys_dist.data.formats.base import RequestLayout, refuse_list, register_format, typed_floats
from recsys_dist.data.formats.history import UserHistory, is_parquet
from recsys_dist.data.formats.schema_request import schema_layout
from recsys_dist.data.mapping import SparseKeys, text_keys
from recsys_dist.data.text import count_rows, line_blocks, parse_block, parse_hex_keys, read_head, rows_then_bad_line
from recsys_dist.errors import DataError

_NUMBER = r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"
_HEX = r"^[0-9a-fA-F]{1,8}$"  # a hex_categorical value (after trimming spaces), as Criteo's C1..C26


def _missing(col: pa.Array) -> np.ndarray:
    """bool [N]: null, or empty text (after trimming spaces)."""
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return pc.equal(pc.utf8_trim_whitespace(pc.fill_null(col, "")), "").to_numpy(zero_copy_only=False)
    return col.is_null().to_numpy(zero_copy_only=False)


def _floats(col: pa.Array, where: str, first_line: int, lines: np.ndarray | None = None) -> np.ndarray:
    """Text -> float64 (empty -> NaN). Raises DataError naming the line of a bad value (``lines[i]``)."""
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return typed_floats(col, where)
    text = pc.utf8_trim_whitespace(pc.fill_null(col, ""))
    try:
        return (
            pc.cast(pc.if_else(pc.equal(text, ""), None, text), pa.float64())
            .fill_null(np.nan)
            .to_numpy(zero_copy_only=False)
        )
    except pa.ArrowInvalid:
        for i, v in enumerate(text.to_pylist()):
            try:
                float(v) if v else None
            except ValueError:
                at = first_line + i if lines is None else lines[i]
                raise DataError(f"{where}, line {at}: '{v}' is not a number") from None
        raise


def _parquet_file(path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(
            f"{path}: cannot read as Parquet ({err}); is it a Parquet file? (data.schema.file_type: "
            "csv reads it as delimited text)"
        ) from None


def _to_text(col: pa.Array, type_: pa.DataType, path: str, name: str, first_row: int) -> pa.Array:
    """A Parquet column as text (or a list of text). Raises DataError naming the row of a
    value that is not UTF-8 text (a ``binary`` column)."""
    try:
        return pc.cast(col, type_)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        for i, v in enumerate(col.to_pylist()):
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, bytes):
                    try:
                        x.decode("utf-8")
                    except UnicodeDecodeError:
                        raise DataError(
                            f"{path}, row {first_row + i}, column {name}: {x[:40]!r} is not UTF-8 text"
                        ) from None
        raise DataError(
            f"{path}, rows {first_row}..{first_row + len(col) - 1}, column {name}: cannot be read as text ({err})"
        ) from None


class SchemaFormat:
    """A raw format from a ``data.schema`` section (a ``SchemaConfig``); see the module doc."""

    name = "schema"

    def __init__(self, spec) -> None:
        self.spec = spec
        self.label_column = spec.label_columns()[0]
        self.task_names, self.task_kinds = spec.task_names(), spec.task_kinds()
        # (task, raw column, kind, threshold) per task; the one-task ``label`` form is task "label"
        self.tasks = (
            [("label", spec.label, "binary", spec.label_threshold)]
            if spec.label is not None
            else [(n, t.column, t.kind, t.threshold) for n, t in spec.labels.items()]
        )
        # Parquet columns of the labels: "label" for the one-task form, else "label:<task>"
        self.label_columns = ["label"] if spec.label is not None else [f"label:{n}" for n in spec.labels]
        self.weight_column = "weight" if spec.weight is not None else None
        self.dense_names = list(spec.dense)
        history = getattr(spec, "history", None)
        self.sequence_names = list(getattr(spec, "sequence", None) or {}) + hist.history_sequences(history)
        self.value_names = [f"{history.name}_time"] if history and getattr(history, "times", False) else []
        self.sparse_names = list(spec.categorical) + list(spec.multi_hot) + self.sequence_names + self.value_names
        key = dict(spec.model_dump(mode="json") if hasattr(spec, "model_dump") else vars(spec))
        for option in ("hex_categorical", "sequence", "history", "labels", "weight"):
            if not key.get(option):
                key.pop(option, None)  # the key of conversions from before the option
        hist.drop_defaults(key.get("history"))  # the key of conversions from before ties / action / times
        self.fingerprint = "schema:" + json.dumps(key, sort_keys=True)
        self.hex = set(getattr(spec, "hex_categorical", None) or [])

        def rule(column, kind, threshold):
            if kind == "regression":
                return f"{column} (a finite number)"
            return f"1 if {column} >= {threshold} else 0" if threshold is not None else f"{column} (0 or 1)"

        self.transforms = {
            "label": "; ".join(
                (f"{c}: " if c != "label" else "") + f"{rule(col, k, th)} as float32"
                for c, (_, col, k, th) in zip(self.label_columns, self.tasks)
            ),
            "dense": ("log1p(max(x, 0))" if spec.dense_transform == "log1p" else "x") + " as float32; empty -> 0",
            "sparse": "id = 1 + key mod (num_embeddings - 1) as int64; empty -> 0",
            "multi_hot": f"split on {spec.separator!r}, empty elements dropped, each element mapped like a "
            "categorical value; list<int64>",
            "key": "BLAKE2b with an 8-byte digest of the value's UTF-8 text, read as a little-endian uint64"
            + (f"; columns {sorted(self.hex)}: the hex value as an unsigned 32-bit integer" if self.hex else ""),
        }
        if spec.weight is not None:
            self.transforms["weight"] = f"weight: {spec.weight} as float32 (a finite number >= 0)"
        if self.sequence_names:
            self.transforms["sequence"] = (
                "split on the column's separator, empty elements dropped, the last max_length kept, each element "
                "mapped like a categorical value; list<int64>, oldest first"
            )
        if history:
            self.transforms["history"] = hist.history_transform(history)
        self.raw_columns: list[str] | None = None
        self.user_history = UserHistory(history.max_length, history.ties) if history else None

    # ---------------------------------------------------------------- reading

    def _header(self, path: str) -> list[str]:
        s = self.spec
        if not s.header:
            if not s.columns:
                raise DataError(f"{path}: data.schema.header is false, so data.schema.columns must name every field")
            return list(s.columns)
        try:
            names = first_line_fields(path, s.delimiter)
        except pa.ArrowInvalid as err:
            raise DataError(
                f"{path}, line 1 (the header line): {err} (is this a delimited text file? "
                f"data.schema.delimiter is {s.delimiter!r})"
            ) from None
        if names is None:
            return list(s.columns or [])
        found = [str(v).strip() for v in names]
        if not s.columns:
            return found
        columns = self._columns()
        # columns rename the header line's fields by position: a name that the header line has
        # at another position is a column list written for another order of the same fields
        # (another export of the data), which would swap features silently.
        moved = [(c, found.index(c)) for i, c in enumerate(columns) if c in found and found.index(c) != i]
        if moved:
            name, at = moved[0]
            raise DataError(
                f"{path}, line 1 (the header line): data.schema.columns {columns} rename the header's fields by "
                f"position, but put {name!r} at position {columns.index(name) + 1}, where the header line has it "
                f"at position {at + 1} ({found}): the fields would be read under other names. List the columns in "
                "the header's order, or remove data.schema.columns to read the fields by the header's names"
            )
        return list(s.columns)

    def _columns(self) -> list[str]:
        """The fields ``data.schema.columns`` names in a file of this format, in order."""
        return list(self.spec.columns or [])

    def _check_columns(self, path: str, names: list[str], where: str) -> None:
        s = self.spec
        needed = [
            *s.label_columns(),
            *([s.weight] if s.weight else []),
            *s.dense,
            *s.categorical,
            *s.multi_hot,
            *(getattr(s, "sequence", None) or {}),
        ]
        if getattr(s, "history", None) is not None:
            needed += [c for c in hist.history_columns(s.history) if c not in needed]
        missing = [c for c in needed if c not in names]
        if missing:
            hint = (
                "; if the file has no header line, set data.schema.header: false and name its fields in "
                "data.schema.columns"
                if where == "header" and not s.columns
                else ""
            )
            raise DataError(
                f"{path}: columns {missing} named in data.schema are not in the file ({where}: {names}){hint}"
            )
        self.raw_columns = names

    def count_rows(self, path: str | os.PathLike) -> int:
        if is_parquet(self.spec, str(path)):
            return _parquet_file(str(path)).metadata.num_rows
        n = count_rows(path)
        return max(n - 1, 0) if self.spec.header else n

    def read_chunks(
        self, path: str, skipped: list | None = None, max_rows: int | None = None
    ) -> Iterator[tuple[int, pa.Table]]:
        """``(first line, table of text columns)`` per block; Parquet row groups are read as
        they are and numbers turned into text, lists into lists of text. ``max_rows``: text
        files stop after that many lines past the header (Parquet: cut by the caller)."""
        if is_parquet(self.spec, path):
            yield from self._parquet_chunks(path)
            return
        names = self._header(path)
        self._check_columns(path, names, "header" if self.spec.header else "data.schema.columns")
        line, first = 1, True
        for chunk in line_blocks(path, None if max_rows is None else max_rows + bool(self.spec.header)):
            header = first and self.spec.header
            parse = partial(
                parse_block,
                chunk,
                path,
                line,
                names,
                delimiter=self.spec.delimiter,
                quote_char='"',
                header=header,
                skipped=skipped,
                describe=lambda row: (
                    f"expected {row.expected_columns} fields, got "
                    f"{row.actual_columns} (the columns are {names}, separated by "
                    f"{self.spec.delimiter!r})"
                ),
            )
            yield from rows_then_bad_line(line + header, parse)
            line += chunk.count(b"\n")
            first = False

    def _parquet_chunks(self, path: str) -> Iterator[tuple[int, pa.Table]]:
        f = _parquet_file(path)
        self._check_columns(path, f.schema_arrow.names, "Parquet schema")
        row = 1
        batches = f.iter_batches(batch_size=65536)
        while True:
            try:
                batch = next(batches, None)
            except (OSError, pa.ArrowException) as err:
                raise DataError(f"{path}, from row {row}: cannot read the Parquet data ({err})") from None
            if batch is None:
                return
            cols = {}
            for name, col in zip(batch.schema.names, batch.columns):
                if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                    refuse_list(self.spec, path, name, col.type)  # a list where one value is read
                    cols[name] = _to_text(col, pa.list_(pa.string()), path, name, row)
                elif name in self.spec.multi_hot or name in self.spec.categorical or name in self._text_columns():
                    cols[name] = _to_text(col, pa.string(), path, name, row)
                else:
                    cols[name] = col
            yield row, pa.table(cols)
            row += batch.num_rows

    # ---------------------------------------------------------------- checking

    def _labels(self, batch: pa.RecordBatch, where: str, first_line: int) -> np.ndarray:
        """float32 [N] (one task) or [N, T] (``data.schema.labels``). Raises DataError naming
        the line and column of a value that is not a label."""
        out = []
        for _, column, kind, threshold in self.tasks:
            x = _floats(batch.column(column), f"{where}, column {column}", first_line)
            numeric = kind == "regression" or threshold is not None
            bad = ~np.isfinite(x) if numeric else ~np.isin(x, (0.0, 1.0))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                value = batch.column(column)[i].as_py()
                if value is None or not str(value).strip():  # a null or an empty field: no threshold helps
                    why = f"the label is missing ({'null' if value is None else 'empty'}); drop the row, or skip "
                    why += "such rows with data.on_bad_row=skip"
                else:
                    want = (
                        ("a number" if np.isnan(x[i]) else "a finite number")
                        if numeric
                        else "0 or 1 (or set a threshold: data.schema.label_threshold / labels.<task>.threshold)"
                    )
                    why = f"'{value}' is not {want}"
                raise DataError(f"{where}, line {first_line + i}, column {column}: {why}")
            out.append((x >= threshold if threshold is not None else x).astype(np.float32))
        return out[0] if self.spec.label is not None else np.stack(out, axis=1)

    def weights(self, batch: pa.RecordBatch, path: str, first_row: int) -> np.ndarray:
        """The sample weights, float32 [N]. Raises DataError naming the file, line (row for
        Parquet) and column of a weight that is empty, not a number, negative or not finite."""
        s = self.spec
        first_line = first_row + (1 if s.header and not is_parquet(s, path) else 0)
        x = _floats(batch.column(s.weight), f"{path}, column {s.weight}", first_line)
        bad = ~np.isfinite(x) | (x < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(
                f"{path}, {'row' if is_parquet(s, path) else 'line'} {first_line + i}, column {s.weight}: "
                f"'{batch.column(s.weight)[i].as_py()}' is not a finite number >= 0 (data.schema.weight: the "
                "sample weight of every row)"
            )
        return x.astype(np.float32)

    def bad_row_mask(self, batch: pa.RecordBatch) -> tuple[np.ndarray, list[str]]:
        """Rows whose label or a dense value the transforms reject, and why (first reason per row)."""
        bad = np.zeros(batch.num_rows, dtype=bool)
        reason = np.full(batch.num_rows, None, dtype=object)
        s = self.spec
        checks = [
            (col, _NUMBER if kind == "regression" or th is not None else r"^[01](\.0*)?$", False)
            for _, col, kind, th in self.tasks
        ]
        binary01 = {col for _, col, kind, th in self.tasks if kind == "binary" and th is None}
        if s.weight is not None:
            checks.append((s.weight, r"^\+?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$", False))
        for name, pattern, empty_ok in checks + [(n, _NUMBER, True) for n in s.dense]:
            col = batch.column(name)
            if not pa.types.is_string(col.type):  # typed Parquet column
                x = typed_floats(col)  # a type of no numbers: every row bad
                ok = np.isfinite(x) | (empty_ok & col.is_null().to_numpy(zero_copy_only=False))
                if name in binary01:
                    ok &= np.isin(x, (0.0, 1.0))
                if name == s.weight:
                    ok &= x >= 0
            else:
                text = pc.utf8_trim_whitespace(pc.fill_null(col, ""))
                ok = pc.match_substring_regex(text, pattern).to_numpy(zero_copy_only=False)
                if empty_ok:
                    ok |= pc.equal(text, "").to_numpy(zero_copy_only=False)
            new = ~ok & ~bad
            for i in np.flatnonzero(new)[:10]:
                reason[i] = f"column {name}: '{col[int(i)].as_py()}'"
            bad |= ~ok
        for name in [n for n in [*s.categorical, *s.multi_hot] if n in self.hex]:
            col_bad = self._hex_bad_rows(name, batch.column(name))
            for i in np.flatnonzero(col_bad & ~bad)[:10]:
                reason[i] = f"column {name}: '{batch.column(name)[int(i)].as_py()}' is not hex"
            bad |= col_bad
        return bad, [r or "invalid value" for r in reason[bad]]

    def _text_columns(self) -> set[str]:
        """Sequence and history (user, item) columns, read as text."""
        s = self.spec
        out = set(getattr(s, "sequence", None) or {})
        if getattr(s, "history", None) is not None:
            out |= {s.history.user, s.history.item, *([s.history.action] if s.history.action else [])}
        return out

    def _elements(self, col: pa.Array, separator: str | None = None) -> tuple[pa.Array, np.ndarray]:
        """A multi-hot column's elements (text, spaces trimmed, empty ones kept) and the row of each."""
        sep = separator or self.spec.separator
        lists = col if pa.types.is_list(col.type) else pc.split_pattern(pc.fill_null(col, ""), sep)
        flat = pc.utf8_trim_whitespace(pc.fill_null(pc.list_flatten(lists), ""))
        return flat, pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)

    def _hex_bad_rows(self, name: str, col: pa.Array) -> np.ndarray:
        """bool [N]: rows of a hex_categorical column with a value (element) that is not hex."""
        if name in self.spec.multi_hot:
            flat, parent = self._elements(col)
            ok = pc.or_(pc.equal(flat, ""), pc.match_substring_regex(flat, _HEX)).to_numpy(zero_copy_only=False)
            bad = np.zeros(len(col), dtype=bool)
            bad[parent[~ok]] = True
            return bad
        text = pc.utf8_trim_whitespace(pc.fill_null(col, ""))
        return ~pc.or_(pc.equal(text, ""), pc.match_substring_regex(text, _HEX)).to_numpy(zero_copy_only=False)

    def _keys(self, name: str, values: pa.Array, where: str, first_line: int) -> tuple[np.ndarray, np.ndarray]:
        """(uint64 keys, present) of a column's values: hex numbers for hex_categorical, else text hashes."""
        if name in self.hex:
            return parse_hex_keys(pc.utf8_trim_whitespace(pc.fill_null(values, "")), where, first_line)
        return text_keys(values)

    # ---------------------------------------------------------------- transforming

    def parse_batch(self, batch: pa.RecordBatch, path: str, first_row: int):
        """Raw batch -> (labels float32 [N], dense float32 [N] per dense column,
        :class:`SparseKeys` per categorical then multi-hot column).

        Raises:
            DataError: a label or dense value that is not a (finite) number, naming the
                file, line (row for Parquet) and column.
        """
        s = self.spec
        first_line = first_row + (1 if s.header and not is_parquet(s, path) else 0)
        labels = self._labels(batch, path, first_line)
        dense = []
        for n in s.dense:
            col = batch.column(n)
            x = _floats(col, f"{path}, column {n}", first_line)
            bad = ~np.isfinite(x) & ~_missing(col)  # NaN / inf written in the file (empty is missing: 0)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                parquet = is_parquet(s, path)
                raise DataError(
                    f"{path}, {'row' if parquet else 'line'} {first_line + i}, column {n}: "
                    f"'{col[i].as_py()}' is not a finite number (a missing value is "
                    f"{'null' if parquet else 'an empty field'})"
                )
            x = np.nan_to_num(x, nan=0.0)
            dense.append((np.log1p(np.maximum(x, 0.0)) if s.dense_transform == "log1p" else x).astype(np.float32))
        for n in [c for c in [*s.categorical, *s.multi_hot] if c in self.hex]:
            bad = self._hex_bad_rows(n, batch.column(n))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise DataError(
                    f"{path}, {'row' if is_parquet(s, path) else 'line'} {first_line + i}, column {n}: "
                    f"'{batch.column(n)[i].as_py()}' is not a hex number of at most 8 digits "
                    "(data.schema.hex_categorical)"
                )
        sparse = [SparseKeys(*self._keys(n, batch.column(n), f"{path}, column {n}", first_line)) for n in s.categorical]
        for n in s.multi_hot:
            flat, parent = self._elements(batch.column(n))
            keep = pc.not_equal(flat, "").to_numpy(zero_copy_only=False)
            keys, _ = self._keys(n, flat.filter(pa.array(keep)), f"{path}, column {n}", first_line)
            lengths = np.bincount(parent[keep], minlength=batch.num_rows).astype(np.int32)
            sparse.append(SparseKeys(keys, None, lengths))
        for n, seq in (getattr(s, "sequence", None) or {}).items():
            sparse.append(self._sequence(batch.column(n), seq, f"{path}, column {n}", first_line))
        if self.user_history is not None:
            sparse.extend(self._derive_history(batch, path, first_line))
        return labels, dense, sparse

    def _sequence(self, col: pa.Array, seq, where: str, first_line: int) -> SparseKeys:
        """A sequence column's keys: non-empty elements, the last ``max_length`` of each row."""
        flat, parent = self._elements(col, seq.separator)
        keep = pc.not_equal(flat, "").to_numpy(zero_copy_only=False)
        parent = parent[keep]
        counts = np.bincount(parent, minlength=len(col))
        # position from the end of its row: keep the row's last max_length elements
        ends = np.cumsum(counts)
        from_end = ends[parent] - 1 - np.arange(len(parent))
        recent = from_end < seq.max_length
        keys, _ = self._keys("", flat.filter(pa.array(keep)).filter(pa.array(recent)), where, first_line)
        lengths = np.minimum(counts, seq.max_length).astype(np.int32)
        return SparseKeys(keys, None, lengths)

    def _derive_history(self, batch: pa.RecordBatch, path: str, first_line: int) -> list[SparseKeys]:
        """The history's features: items, then (if configured) actions, times (``hist.derive_features``)."""
        h, lines = self.spec.history, hist.file_lines(batch)  # lines: under data.on_bad_row: skip, the rows' own
        times = _floats(batch.column(h.time), f"{path}, column {h.time}", first_line, lines)
        bad = ~np.isfinite(times)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(
                f"{hist.where(self.spec, path, first_line, i, lines)}, column {h.time}: '{batch.column(h.time)[i].as_py()}' "
                "is not a number (data.schema.history.time needs a time on every row)"
            )
        return hist.derive_features(self.user_history, h, batch, times, path, first_line, self.spec)

    def unlabelled(self, path: str | os.PathLike) -> SchemaFormat | None:
        """:class:`UnlabelledSchemaFormat` when the file has no ``data.schema.label`` column."""
        names = _file_columns(self.spec, str(path))
        if names is None or self.spec.label_columns()[0] in names:
            return None
        return UnlabelledSchemaFormat(self.spec)

    def request_layout(self) -> RequestLayout:
        """Request rows: ``recsys_dist.data.formats.schema_request``; read unlabelled in memory."""
        return schema_layout(self.spec, partial(UnlabelledSchemaFormat, self.spec))

    def output_schema(self) -> pa.Schema:
        """Label column(s) first, then dense, categorical, multi-hot, sequence, and ``weight`` last."""
        fields = [pa.field(c, pa.float32()) for c in self.label_columns]
        fields += [pa.field(n, pa.float32()) for n in self.dense_names]
        fields += [pa.field(n, pa.int64()) for n in self.spec.categorical]
        fields += [pa.field(n, pa.list_(pa.int64())) for n in self.spec.multi_hot]
        fields += [pa.field(n, pa.list_(pa.int64())) for n in self.sequence_names]
        fields += [pa.field(n, pa.list_(pa.int64())) for n in self.value_names]
        if self.weight_column:
            fields.append(pa.field(self.weight_column, pa.float32()))
        return pa.schema(fields)


class UnlabelledSchemaFormat(SchemaFormat):
    """``data.format: schema`` for a file without the ``data.schema.label`` column: scoring
    only; every label is a placeholder 0 (reported as missing). With ``data.schema.columns``,
    the file's fields are those columns without the label, in the same order."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.name = "schema_unlabelled"
        self.fingerprint = "schema_unlabelled:" + self.fingerprint
        self.transforms = {**self.transforms, "label": "no label column: a placeholder 0"}

    def _header(self, path: str) -> list[str]:
        names = super()._header(path)
        return hist.without_label(self.spec, names) if self.spec.columns else names

    def _columns(self) -> list[str]:
        return hist.without_label(self.spec, super()._columns())

    def _check_columns(self, path: str, names: list[str], where: str) -> None:
        s = self.spec
        history = hist.history_columns(s.history) if s.history else []  # its action may be the label column
        missing = [c for c in (*s.dense, *s.categorical, *s.multi_hot, *history) if c not in names]
        if missing:
            raise DataError(f"{path}: columns {missing} named in data.schema are not in the file ({where}: {names})")
        self.raw_columns = names

    def _labels(self, batch: pa.RecordBatch, where: str, first_line: int) -> np.ndarray:
        if self.spec.label is None:  # several tasks: [N, T] placeholders
            return np.zeros((batch.num_rows, len(self.tasks)), np.float32)
        return np.zeros(batch.num_rows, np.float32)

    def bad_row_mask(self, batch: pa.RecordBatch):
        # a label column here is history.action's (the rating): not checked as a label
        labelled = batch.drop_columns([c for c in self.spec.label_columns() if c in batch.schema.names])
        for column in self.spec.label_columns():
            labelled = labelled.append_column(column, pa.array(np.full(batch.num_rows, "0")))
        return super().bad_row_mask(labelled)

    def unlabelled(self, path: str | os.PathLike) -> None:
        return None


def first_line_fields(path: str, delimiter: str) -> list | None:
    """The fields of a delimited text file's first line, parsed as the reader parses it
    (quotes included); None when that line is empty.

    Raises:
        pyarrow.ArrowInvalid: the line is not delimited text.
    """
    first = read_head(path, 1 << 16).split(b"\n", 1)[0]
    if not first.strip():
        return None
    row = pacsv.read_csv(
        pa.py_buffer(first + b"\n"),
        read_options=pacsv.ReadOptions(autogenerate_column_names=True),
        parse_options=pacsv.ParseOptions(delimiter=delimiter),
        convert_options=pacsv.ConvertOptions(strings_can_be_null=False),
    ).to_pylist()[0]
    return list(row.values())


def _file_columns(spec, path: str) -> list[str] | None:
    """The column names of a raw schema-format file as its reader sees them: the Parquet
    schema, the header line, or (no header) ``columns`` cut to the first line's field count;
    None when they cannot be told (the conversion then reports the problem)."""
    if is_parquet(spec, path):
        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except (OSError, pa.ArrowException):
            return None
    try:
        row = first_line_fields(path, spec.delimiter)
    except pa.ArrowInvalid:
        return None
    if row is None:
        return None
    if spec.header and not spec.columns:
        return [str(v).strip() for v in row]
    cols = list(spec.columns)
    if len(row) == len(cols) - 1 and spec.label in cols:  # every field but the label
        return [c for c in cols if c != spec.label]
    return cols


@register_format("schema")
def _schema(schema, short_lines: str = "error") -> SchemaFormat:
    if schema is None:
        raise ValueError("data.format 'schema' needs a data.schema section")
    return SchemaFormat(schema)
