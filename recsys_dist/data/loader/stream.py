"""Reading a window of row groups into numpy columns, checked (nulls, ids out of range,
non-finite labels, dense values and weights are errors naming the file and row)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from recsys_dist.data.loader.columns import Columns
from recsys_dist.data.parquet_io import open_parquet
from recsys_dist.errors import DataError

_INT32 = np.iinfo(np.int32)


def is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def check_types(path: str, schema: pa.Schema, sparse: set[str]) -> None:
    """Sparse columns must hold integers (or lists of them), the others numbers: a float id
    would be truncated to an integer silently, a string fail deep in numpy.

    Raises:
        DataError: naming the file, the column, its type and the fix.
    """
    for field in schema:
        t = field.type
        if field.name in sparse:
            item = t.value_type if is_list_type(t) else t
            if not pa.types.is_integer(item):
                raise DataError(
                    f"{path}, column {field.name}: a sparse feature's ids must be integers (or lists of "
                    f"integers), found {t}; map the values to integer ids first (recsys-dist preprocess does)"
                )
        elif not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            raise DataError(f"{path}, column {field.name}: must be numeric, found {t}; convert it to numbers first")


def read_window(loader, groups: list[int], handles: dict) -> Columns:
    """``loader``'s window of row groups ``groups`` (indices into ``loader.row_groups``) as checked
    numpy columns (:func:`table_columns`, the loader's ``layout.columns``). ``handles``: open
    Parquet files by file index, reused across windows.

    Raises:
        DataError: as :func:`table_columns`, naming the file and row (0-based, in that file).
    """
    return loader.layout.columns(_read_table(loader, groups, handles), _locator(loader, groups))


def table_columns(
    t: pa.Table,
    label_columns: list[str],
    dense_names: list[str],
    keys: list[str],
    id_bounds: list[int] | None,
    weight_column: str | None,
    where: Callable[[int], str],
) -> Columns:
    """A converted table's rows as numpy columns (a column list ``<int>`` is multi-hot), each
    joined from its chunks in one copy. One-hot ids whose values fit are narrowed to int32 in
    that copy: gathering them is about twice as fast, and batches widen them back to int64.
    ``id_bounds``: per feature the table's rows (ids must lie in ``[0, bound)``), or None;
    ``where(row)``: how an error names row ``row`` (0-based in ``t``).

    Raises:
        DataError: a null id, an id out of range, a non-finite label or dense value or a bad
            weight, naming (``where``) the row that holds it and the column.
    """
    n = t.num_rows
    labels = _labels(t, n, label_columns, where)
    weights = None
    if weight_column:
        weights = _joined(_chunks(t, weight_column, np.float32), np.empty(n, np.float32))
        bad = ~(weights >= 0) | ~np.isfinite(weights)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise DataError(f"{where(row)}, column {weight_column}: {weights[row]} is not a finite weight >= 0")
    dense = np.empty((n, len(dense_names)), np.float32)
    for d, name in enumerate(dense_names):
        _joined(_chunks(t, name, np.float32), dense[:, d])
    bad = ~np.isfinite(dense)
    if bad.any():
        row, col = map(int, np.argwhere(bad)[0])  # the first bad value in row order
        raise DataError(
            f"{where(row)}, column {dense_names[col]}: {dense[row, col]} is not finite (a null reads as "
            "nan); fill or drop it (recsys-dist preprocess fills missing dense values)"
        )
    ids = []
    for j, name in enumerate(keys):
        size = None if id_bounds is None else id_bounds[j]
        is_list = is_list_type(t.schema.field(name).type)
        ids.append(_ids(t.column(name), n, name, is_list, size, where))
    return Columns(labels, dense, ids, weights)


def _read_table(loader, groups: list[int], handles: dict) -> pa.Table:
    """The window's rows, one read per run of row groups from the same file."""
    row_groups, tables, k = loader.row_groups, [], 0
    while k < len(groups):
        f = row_groups[groups[k]][0]
        run = [row_groups[groups[k]][1]]
        while k + len(run) < len(groups) and row_groups[groups[k + len(run)]][0] == f:
            run.append(row_groups[groups[k + len(run)]][1])
        if f not in handles:  # opening a Parquet file costs more than reading a row group
            handles[f] = open_parquet(loader.files[f])  # decodes into the system pool: see parquet_io
        tables.append(handles[f].read_row_groups(run, columns=loader.columns))
        k += len(run)
    return pa.concat_tables(tables)


def _locator(loader, groups: list[int]) -> Callable[[int], str]:
    """``row -> "file, row R"`` for the window's rows: a window spans row groups of several
    files, in this epoch's order, so its rows are not the rows of its first file."""

    def where(row: int) -> str:
        for i in groups:
            f, g, rows = loader.row_groups[i]
            if row < rows:
                before = sum(m for f2, g2, m in loader.row_groups if f2 == f and g2 < g)
                return f"{loader.files[f]}, row {before + row}"
            row -= rows
        raise AssertionError("row past the window")

    return where


def _chunks(t: pa.Table, name: str, dtype) -> list[np.ndarray]:
    """Column ``name``'s chunks as numpy: zero-copy views when Arrow's type is ``dtype``."""
    return [c.to_numpy(zero_copy_only=False).astype(dtype, copy=False) for c in t.column(name).chunks]


def _joined(parts: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``parts`` copied (and cast) one after another into ``out``: one copy."""
    o = 0
    for p in parts:
        out[o : o + len(p)] = p
        o += len(p)
    return out


def _labels(t: pa.Table, n: int, label_columns: list[str], where) -> np.ndarray:
    """float32 [n] (one label column) or [n, T]; a null reads as NaN and is an error."""
    if len(label_columns) == 1:
        labels = _joined(_chunks(t, label_columns[0], np.float32), np.empty(n, np.float32))
    else:
        labels = np.empty((n, len(label_columns)), np.float32)
        for k, name in enumerate(label_columns):
            _joined(_chunks(t, name, np.float32), labels[:, k])
    bad = ~np.isfinite(labels)  # a null reads as NaN: the loss and the metrics would be NaN
    if bad.any():
        row, *task = map(int, np.argwhere(bad)[0])
        raise DataError(
            f"{where(row)}, column {label_columns[task[0] if task else 0]}: label "
            f"{labels[(row, *task)]} is not finite (null or NaN); drop the row or give it a label"
        )
    return labels


def _ids(column: pa.ChunkedArray, n: int, name: str, is_list: bool, size: int | None, where):
    """A sparse column's ids: int32 / int64 [n] (one-hot), or (lengths int64 [n], values int64)
    (multi-hot); ``size``: the table's rows (ids must lie in ``[0, size)``), or None."""
    lengths = None
    if is_list:
        # Chunk by chunk (combine_chunks would copy the lists into the default pool).
        pieces = column.chunks
        lengths = [c.value_lengths().fill_null(0).to_numpy(zero_copy_only=False) for c in pieces]
        lengths = _joined(lengths, np.empty(n, np.int64))
        arrays = [c.flatten() for c in pieces]  # the ids; a null list's slots hold none
    else:
        arrays = column.chunks
    if any(a.null_count for a in arrays):  # to_numpy would make it a float NaN, then a garbage id
        first = int(np.flatnonzero(np.concatenate([a.is_null().to_numpy(zero_copy_only=False) for a in arrays]))[0])
        row = int(np.searchsorted(np.cumsum(lengths), first, side="right")) if is_list else first
        raise DataError(
            f"{where(row)}, column {name}: a null id (every id must be set: give missing values an id "
            "of their own, as recsys-dist preprocess does with 0)"
        )
    parts = [a.to_numpy(zero_copy_only=False).astype(np.int64, copy=False) for a in arrays]
    sized = [p for p in parts if p.size]
    lo, hi = (min(int(p.min()) for p in sized), max(int(p.max()) for p in sized)) if sized else (0, 0)
    if size is not None and sized and (lo < 0 or hi >= size):
        flat = np.concatenate(parts)
        first = int(np.flatnonzero((flat < 0) | (flat >= size))[0])
        row = int(np.searchsorted(np.cumsum(lengths), first, side="right")) if is_list else first
        raise DataError(
            f"{where(row)}, column {name}: ids must lie in [0, {size}), found "
            f"{flat[first]} (this window's ids span [{lo}, {hi}]; convert again with the table size "
            "in the config)"
        )
    if is_list:
        return lengths, parts[0] if len(parts) == 1 else np.concatenate([np.zeros(0, np.int64), *parts])
    # joining the row groups' chunks and narrowing to int32 is one pass
    fits = _INT32.min <= lo and hi <= _INT32.max
    return _joined(parts, np.empty(n, np.int32 if fits else np.int64))
