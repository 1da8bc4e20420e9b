"""Criteo TSV (Kaggle DAC / 1TB click logs) to Parquet, streamed in bounded memory.

Raw layout: ``label, I1..I13, C1..C26``, tab-separated, no header, an empty field is
a missing value. Transforms (the same for every split):

- label: int in {0, 1} -> float32.
- dense ``I1..I13``: ``log1p(max(x, 0))`` as float32; empty -> 0.
- categorical ``C1..C26``: the 8-hex-digit value parsed as an unsigned 32-bit
  integer ``h`` (the key); hash mapping: id = ``1 + h mod (num_embeddings - 1)`` as
  int64 (vocabulary mapping: ``recsys_dist.data.mapping``); empty -> 0 (row 0 of every
  table is reserved for "missing"). Ids are therefore always in ``[0, num_embeddings)``.

Splits: ``recsys_dist.data.splits``. Memory: one pyarrow block (``BLOCK_BYTES`` of
text) is in flight at a time, whatever the file size.
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recsys_dist.data.mapping import SparseKeys, hash_ids

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
COLUMNS = ["label"] + DENSE_NAMES + SPARSE_NAMES
SPLITS = ("train", "validation", "test")
BLOCK_BYTES = 8 << 20
TRANSFORM_VERSION = 1

_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


class DataError(ValueError):
    """Raw or converted data is malformed; the message names file, row and column."""


def count_rows(path: str | os.PathLike) -> int:
    """Number of rows (a last line without newline counts too); gzip/bz2 are decompressed."""
    n, last = 0, b"\n"
    with pa.input_stream(str(path), compression="detect") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def parse_hex_keys(col: pa.Array, where: str, first_row: int) -> tuple[np.ndarray, np.ndarray]:
    """Hex strings -> (uint64 keys [N] = the unsigned 32-bit value, present [N]); empty or null
    is not present (key 0).

    Args:
        col: pyarrow string array of 0..8 hex digits per value.
        where: file and column, used in error messages.
        first_row: 1-based line number of ``col[0]`` in the file, for error messages.

    Raises:
        DataError: a value longer than 8 characters or not hexadecimal.
    """
    col = pc.fill_null(col, "")
    lengths = pc.binary_length(col).to_numpy(zero_copy_only=False)
    too_long = np.flatnonzero(lengths > 8)
    if too_long.size:
        i = int(too_long[0])
        raise DataError(f"{where}, line {first_row + i}: '{col[i].as_py()}' is not an 8-digit hex id")
    # Left-pad to exactly 8 bytes so the string data buffer is an [N, 8] byte matrix (no copy).
    padded = pc.utf8_lpad(col, 8, "0").combine_chunks() if isinstance(col, pa.ChunkedArray) else pc.utf8_lpad(col, 8, "0")
    offsets = np.frombuffer(padded.buffers()[1], dtype=np.int32, count=len(padded) + 1, offset=padded.offset * 4)
    data = np.frombuffer(padded.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    digits = _HEX[data.reshape(-1, 8)]
    present = lengths > 0
    bad = np.flatnonzero(present & (digits == 255).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise DataError(f"{where}, line {first_row + i}: '{col[i].as_py()}' is not an 8-digit hex id")
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    h = (digits.astype(np.uint64) << shifts).sum(axis=1)
    h[~present] = 0
    return h, present


def parse_hex_ids(col: pa.Array, num_embeddings: int, where: str, first_row: int) -> np.ndarray:
    """Hex strings -> int64 ids ``1 + uint32(hex) mod (num_embeddings - 1)``; empty or null -> 0
    (see :func:`parse_hex_keys` for the arguments and errors)."""
    h, present = parse_hex_keys(col, where, first_row)
    ids = hash_ids(h, num_embeddings)
    ids[~present] = 0
    return ids


def transform_dense(col: pa.Array) -> np.ndarray:
    """int64 (nullable) -> float32 ``log1p(max(x, 0))``, null -> 0."""
    x = col.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64)
    return np.log1p(np.maximum(x, 0.0)).astype(np.float32)


def output_schema() -> pa.Schema:
    fields = [pa.field("label", pa.float32())]
    fields += [pa.field(n, pa.float32()) for n in DENSE_NAMES]
    fields += [pa.field(n, pa.int64()) for n in SPARSE_NAMES]
    return pa.schema(fields)


def parse_batch(batch: pa.RecordBatch, path: str, first_row: int):
    """One raw record batch -> (labels float32 [N], dense float32 [N] per I column,
    :class:`SparseKeys` per C column); see the module docstring.

    Raises:
        DataError: a label other than 0/1, a non-integer dense value, a non-hex categorical
            value, naming the file, line and column.
    """
    label = parse_ints(batch.column("label"), f"{path}, column label", first_row)
    if label.null_count:
        i = int(np.flatnonzero(label.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}, line {first_row + i}, column label: empty label")
    lab = label.to_numpy(zero_copy_only=False)
    if ((lab != 0) & (lab != 1)).any():
        i = int(np.flatnonzero((lab != 0) & (lab != 1))[0])
        raise DataError(f"{path}, line {first_row + i}, column label: {lab[i]} is not 0 or 1")
    dense = [transform_dense(parse_ints(batch.column(n), f"{path}, column {n}", first_row)) for n in DENSE_NAMES]
    sparse = [SparseKeys(*parse_hex_keys(batch.column(n), f"{path}, column {n}", first_row)) for n in SPARSE_NAMES]
    return lab.astype(np.float32), dense, sparse


_INT = r"^\s*[-+]?[0-9]{1,18}\s*$"


def bad_row_mask(batch: pa.RecordBatch) -> tuple[np.ndarray, list[str]]:
    """Which rows hold a value the transforms reject, and why (first reason per row).

    Returns a bool array [N] and, for the bad rows in order, "column X: 'value'" reasons.
    """
    bad = np.zeros(batch.num_rows, dtype=bool)
    reason = np.full(batch.num_rows, None, dtype=object)
    checks = [("label", r"^\s*[01]\s*$", False)] + [(n, _INT, True) for n in DENSE_NAMES] + [
        (n, r"^[0-9a-fA-F]{1,8}$", True) for n in SPARSE_NAMES]
    for name, pattern, empty_ok in checks:
        col = pc.fill_null(batch.column(name), "")
        ok = pc.match_substring_regex(col, pattern)
        if empty_ok:
            ok = pc.or_(pc.equal(col, ""), ok)
        col_bad = ~ok.to_numpy(zero_copy_only=False)
        new = col_bad & ~bad
        for i in np.flatnonzero(new)[:10]:
            reason[i] = f"column {name}: '{col[int(i)].as_py()}'"
        bad |= col_bad
    return bad, [r or "invalid value" for r in reason[bad]]


class _BadRows:
    """Collects rows with the wrong number of fields (pyarrow calls it per bad row)."""

    def __init__(self, labelled: bool = True) -> None:
        self.rows: list = []
        self.labelled = labelled

    def __call__(self, row) -> str:
        self.rows.append(row)
        return "skip"

    def raise_first(self, path: str, line_offset: int = 0) -> None:
        if not self.rows:
            return
        row = self.rows[0]
        where = f"line {row.number + line_offset}" if row.number is not None else "a line"
        if not self.labelled:
            hint = (" (an unlabelled Criteo row has 39 tab-separated fields: I1..I13, C1..C26, as in the "
                    "first line of this file)")
        elif row.actual_columns == NUM_DENSE + NUM_SPARSE:
            hint = (" (the label column seems missing; Kaggle's test.txt has this 39-field layout "
                    "and cannot be used for training; `recsys-dist predict` scores it)")
        else:
            hint = " (a Criteo row has 40 tab-separated fields: label, I1..I13, C1..C26)"
        raise DataError(
            f"{path}, {where}: expected {row.expected_columns} fields, got {row.actual_columns}{hint}"
        )


def _parse_chunk(chunk: bytes, path: str, first_line: int, use_threads: bool,
                 skipped: list | None = None, labelled: bool = True) -> pa.Table:
    bad_rows = _BadRows(labelled)
    columns = COLUMNS if labelled else COLUMNS[1:]
    try:
        table = pacsv.read_csv(
            pa.py_buffer(chunk),
            read_options=pacsv.ReadOptions(column_names=columns, use_threads=use_threads),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, invalid_row_handler=bad_rows),
            convert_options=pacsv.ConvertOptions(
                column_types={n: pa.string() for n in columns}, strings_can_be_null=False
            ),
        )
        if not labelled:  # Kaggle test layout: a placeholder label, reported as missing by score()
            table = table.add_column(0, "label", pa.array(np.full(table.num_rows, "0")))
    except pa.ArrowInvalid as err:
        raise DataError(f"{path}, from line {first_line}: {err}") from None
    if bad_rows.rows:
        if skipped is not None:
            skipped += [(None if r.number is None else r.number + first_line - 1,
                         f"{r.actual_columns} fields, expected {r.expected_columns}") for r in bad_rows.rows]
            return table
        if bad_rows.rows[0].number is None and use_threads:
            return _parse_chunk(chunk, path, first_line, use_threads=False, labelled=labelled)  # to learn the line
        bad_rows.raise_first(path, line_offset=first_line - 1)
    return table


def line_blocks(path: str) -> Iterator[bytes]:
    """The file (gzip / bz2 detected) in blocks of about ``BLOCK_BYTES``, each cut after a
    line end, so only one block is in memory at a time."""
    carry = b""
    with pa.input_stream(path, compression="detect") as f:
        while True:
            block = f.read(BLOCK_BYTES)
            data = carry + block
            if not data:
                return
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if cut == 0:  # a line longer than a block: keep reading
                carry = data
                continue
            yield data[:cut]
            carry = data[cut:]
            if not block:
                return


def read_chunks(path: str, skipped: list | None = None, labelled: bool = True) -> Iterator[tuple[int, pa.Table]]:
    """``(first line number, table of text columns)`` per ~``BLOCK_BYTES`` of the file.

    The file (gzip / bz2 detected) is read block by block and cut at line ends, and each
    block is parsed on all cores; only one block is in memory at a time. (pyarrow's own
    streaming reader reads ahead without bound: a 240 MB file held 215 MB of blocks.)
    Everything is kept as text so a bad value is reported with its line and column.
    With ``skipped`` (a list), rows with the wrong number of fields are appended to it as
    ``(line or None, reason)`` and left out instead of raising. ``labelled=False`` reads
    the 39-field layout of Kaggle's test.txt and adds a placeholder label "0".
    """
    line = 1
    for chunk in line_blocks(path):
        table = _parse_chunk(chunk, path, line, use_threads=True, skipped=skipped, labelled=labelled)
        yield line, table
        line += chunk.count(b"\n") if skipped is not None else table.num_rows


def parse_ints(col: pa.Array, where: str, first_row: int) -> pa.Array:
    """Decimal text -> int64 (empty -> null). Raises DataError naming the line of a bad value."""
    col = pc.fill_null(col, "")
    ok = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, r"^\s*[-+]?[0-9]{1,18}\s*$"))
    if not pc.all(ok).as_py():
        i = int(np.flatnonzero(~ok.to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{where}, line {first_row + i}: '{col[i].as_py()}' is not an integer")
    return pc.cast(pc.utf8_trim_whitespace(pc.if_else(pc.equal(col, ""), None, col)), pa.int64())


class CriteoFormat:
    """Criteo TSV (Kaggle DAC / 1TB click logs): label, I1..I13, C1..C26; see module doc.

    ``labelled=False``: Kaggle's unlabelled test.txt (I1..I13, C1..C26), for scoring only.
    """

    def __init__(self, labelled: bool = True) -> None:
        self.labelled = labelled
        self.name = "criteo_tsv" if labelled else "criteo_tsv_unlabelled"
    raw_columns = COLUMNS
    dense_names = DENSE_NAMES
    sparse_names = SPARSE_NAMES
    transforms = {
        "label": "float32",
        "dense": "log1p(max(x, 0)) as float32; empty -> 0",
        "sparse": "id = 1 + uint32(hex) mod (num_embeddings - 1) as int64; empty -> 0",
        "key": "the 8 hex digits as an unsigned 32-bit integer",
    }

    @staticmethod
    def count_rows(path: str | os.PathLike) -> int:
        return count_rows(path)

    def read_chunks(self, path: str, skipped: list | None = None):
        return read_chunks(path, skipped, self.labelled)

    @staticmethod
    def bad_row_mask(batch: pa.RecordBatch):
        return bad_row_mask(batch)

    @staticmethod
    def parse_batch(batch: pa.RecordBatch, path: str, first_row: int):
        return parse_batch(batch, path, first_row)

    @staticmethod
    def output_schema() -> pa.Schema:
        return output_schema()


CRITEO = CriteoFormat()


def first_line_fields(path: str) -> int:
    """Tab-separated fields on the first line of a (gzip / bz2 detected) file; 0 if empty."""
    with pa.input_stream(str(path), compression="detect") as f:
        head = f.read(1 << 16)
    line = head.split(b"\n", 1)[0]
    return line.count(b"\t") + 1 if line else 0


def prepare_criteo(raw_path, num_embeddings, split=(0.8, 0.1, 0.1), num_rows=None, cache_dir=None,
                   row_group_size: int = 65536, on_bad_row: str = "error", progress: bool = False, **kw):
    """Convert a Criteo TSV file to train/validation/test Parquet once, then reuse it
    (see :func:`recsys_dist.data.convert.prepare`)."""
    from recsys_dist.data.convert import prepare

    return prepare(CRITEO, raw_path, num_embeddings, split, num_rows, cache_dir, row_group_size, on_bad_row, progress,
                   **kw)
