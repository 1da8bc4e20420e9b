"""Criteo TSV (Kaggle DAC / 1TB click logs) to Parquet, streamed in bounded memory.

Raw layout: ``label, I1..I13, C1..C26``, tab-separated, no header, an empty field is
a missing value. Transforms (the same for every split):

- label: int in {0, 1} -> float32.
- dense ``I1..I13``: ``log1p(max(x, 0))`` as float32; empty -> 0.
- categorical ``C1..C26``: the 8-hex-digit value parsed as an unsigned 32-bit
  integer ``h`` (the key); hash mapping: id = ``1 + h mod (num_embeddings - 1)`` as
  int64 (vocabulary mapping: ``recsys_dist.data.mapping``); empty -> 0 (row 0 of every
  table is reserved for "missing"). Ids are therefore always in ``[0, num_embeddings)``.

Lines that leave out trailing empty fields (37-39 fields where 40 are due, as some exports
write them) are bad lines, or with ``short_lines="pad"`` (``data.short_lines: pad``) read
as if the absent trailing fields were empty: missing values.

Splits: ``recsys_dist.data.splits``. Reading: ``recsys_dist.data.text`` (bounded memory).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_dist.data.formats.base import RequestLayout, register_format, write_delimited
from recsys_dist.data.mapping import SparseKeys, hash_ids
from recsys_dist.data.text import (
    BLOCK_BYTES,
    INT_LIMIT,
    INT_PATTERN,
    BadLine,
    count_rows,
    line_blocks,
    pad_short_lines,
    parse_block,
    parse_hex_keys,
    parse_ints,
    read_head,
    rows_then_bad_line,
)
from recsys_dist.errors import DataError

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
COLUMNS = ["label"] + DENSE_NAMES + SPARSE_NAMES


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


_LABEL = r"^\s*(?:[-+]?0+|\+?0*1)\s*$"  # an integer (as text.INT_PATTERN) equal to 0 or 1
_INT_TYPES = {n: pa.int64() for n in ["label", *DENSE_NAMES]}


def bad_row_mask(batch: pa.RecordBatch) -> tuple[np.ndarray, list[str]]:
    """Which rows hold a value the transforms reject, and why (first reason per row).

    Returns a bool array [N] and, for the bad rows in order, "column X: 'value'" reasons.
    """
    bad = np.zeros(batch.num_rows, dtype=bool)
    reason = np.full(batch.num_rows, None, dtype=object)
    checks = (
        [("label", _LABEL, False)]
        + [(n, INT_PATTERN, True) for n in DENSE_NAMES]
        + [(n, r"^[0-9a-fA-F]{1,8}$", True) for n in SPARSE_NAMES]
    )
    for name, pattern, empty_ok in checks:
        col = batch.column(name)
        if not pa.types.is_string(col.type):  # parsed as integers: only the label can be wrong
            if name == "label":
                col_bad = ~pc.fill_null(pc.is_in(col, pa.array([0, 1])), False).to_numpy(zero_copy_only=False)
                for i in np.flatnonzero(col_bad & ~bad)[:10]:
                    reason[i] = f"column label: '{'' if col[int(i)].as_py() is None else col[int(i)].as_py()}'"
                bad |= col_bad
            continue
        col = pc.fill_null(col, "")
        ok = pc.match_substring_regex(col, pattern)
        if empty_ok:
            ok = pc.or_(pc.equal(col, ""), ok)
        col_bad = ~ok.to_numpy(zero_copy_only=False)
        new = col_bad & ~bad
        for i in np.flatnonzero(new)[:10]:
            reason[i] = f"column {name}: '{col[int(i)].as_py()}'"
        bad |= col_bad
    return bad, [r or "invalid value" for r in reason[bad]]


_SHORT_HINT = (
    "if this file's lines leave out trailing empty fields, set data.short_lines: pad to read the absent "
    "fields as missing values"
)


def _describe(labelled: bool):
    """``row -> str``: what is wrong with a Criteo row of the wrong field count, with a hint."""

    def describe(row) -> str:
        short = f"; {_SHORT_HINT}" if row.actual_columns < row.expected_columns else ""
        if not labelled:
            hint = (
                " (an unlabelled Criteo row has 39 tab-separated fields: I1..I13, C1..C26, as in the "
                f"first line of this file{short})"
            )
        elif row.actual_columns == NUM_DENSE + NUM_SPARSE:
            hint = (
                " (the label column seems missing; Kaggle's test.txt has this 39-field layout "
                f"and cannot be used for training; `recsys-dist predict` scores it{short})"
            )
        else:
            hint = f" (a Criteo row has 40 tab-separated fields: label, I1..I13, C1..C26{short})"
        return f"expected {row.expected_columns} fields, got {row.actual_columns}{hint}"

    return describe


def _parse_chunk(
    chunk: bytes,
    path: str,
    first_line: int,
    use_threads: bool,
    skipped: list | None = None,
    labelled: bool = True,
    short_lines: str = "error",
) -> pa.Table:
    columns = COLUMNS if labelled else COLUMNS[1:]
    if short_lines == "pad":
        chunk = pad_short_lines(chunk, len(columns))
    # The label and the integer columns are parsed by pyarrow's CSV reader (on all cores, no
    # text columns to convert later). Its integers are a superset of ours (INT_PATTERN): it also
    # reads hex ("0x10") and 19 digits. So a block with an "x" anywhere, with a value of 10^18
    # or more, or with a value it cannot convert, is parsed again as text, which applies INT_PATTERN
    # and names the line and column of a bad value (or skips its row).
    parse = partial(
        parse_block,
        chunk,
        path,
        first_line,
        columns,
        delimiter="\t",
        describe=_describe(labelled),
        use_threads=use_threads,
    )
    table = None
    if b"x" not in chunk and b"X" not in chunk:
        found: list | None = None if skipped is None else []
        try:
            table = parse(skipped=found, column_types=_INT_TYPES)
        except DataError:
            table = None
        if table is not None and not _ints_in_range(table):
            table = None
        if table is not None and skipped is not None:
            skipped.extend(found)
    if table is None:
        try:
            table = parse(skipped=skipped)
        except BadLine as err:  # the rows before it are read first (rows_then_bad_line): labelled alike
            if not labelled and err.rows_before is not None:
                err.rows_before = _placeholder_label(err.rows_before)
            raise
    return table if labelled else _placeholder_label(table)


def _placeholder_label(table: pa.Table) -> pa.Table:
    """Kaggle's test layout: a placeholder label, reported as missing by score()."""
    return table.add_column(0, "label", pa.array(np.full(table.num_rows, "0")))


def _ints_in_range(table: pa.Table) -> bool:
    """Every integer column of ``table`` (parsed by the CSV reader) within +-(10^18 - 1)."""
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_integer(col.type) and col.length() - col.null_count:
            mm = pc.min_max(col).as_py()
            if mm["min"] <= -INT_LIMIT or mm["max"] >= INT_LIMIT:
                return False
    return True


def read_chunks(
    path: str,
    skipped: list | None = None,
    labelled: bool = True,
    max_rows: int | None = None,
    short_lines: str = "error",
) -> Iterator[tuple[int, pa.Table]]:
    """``(first line number, table of text columns)`` per ~``BLOCK_BYTES`` of the file.

    The file (gzip / bz2 detected) is read block by block and cut at line ends, and each
    block is parsed on all cores; only one block is in memory at a time. (pyarrow's own
    streaming reader reads ahead without bound, so its memory grows with the file; see
    docs/design/0008-bounded-memory-conversion-and-batch-layout-loader.md.)
    Everything is kept as text so a bad value is reported with its line and column.
    With ``skipped`` (a list), bad lines (wrong field count, blank, not UTF-8: see
    :func:`parse_block`) are appended to it as ``(line or None, reason)`` and left out
    instead of raising. ``labelled=False`` reads the 39-field layout of Kaggle's test.txt
    and adds a placeholder label "0". ``max_rows``: read only the first that many lines (bad
    lines after them are never looked at). ``short_lines="pad"``: a line with fewer fields than
    the layout's reads its absent trailing fields as empty (:func:`pad_short_lines`).
    """
    line = 1
    for chunk in line_blocks(path, max_rows):
        parse = partial(_parse_chunk, chunk, path, line, True, skipped, labelled, short_lines)
        yield from rows_then_bad_line(line, parse)
        line += chunk.count(b"\n")


class CriteoFormat:
    """Criteo TSV (Kaggle DAC / 1TB click logs): label, I1..I13, C1..C26; see module doc.

    ``labelled=False``: Kaggle's unlabelled test.txt (I1..I13, C1..C26), for scoring only.
    ``short_lines``: ``"error"`` (a line of fewer fields is a bad line) or ``"pad"`` (its absent
    trailing fields are missing values).
    """

    def __init__(self, labelled: bool = True, short_lines: str = "error") -> None:
        if short_lines not in ("error", "pad"):
            raise ValueError(f"short_lines must be 'error' or 'pad', got {short_lines!r}")
        self.labelled, self.short_lines = labelled, short_lines
        self.name = "criteo_tsv" if labelled else "criteo_tsv_unlabelled"
        # The cache key: the format's name, and the padding only when on (older entries stay valid).
        self.fingerprint = self.name + (":short_lines=pad" if short_lines == "pad" else "")

    raw_columns = COLUMNS
    label_column = "label"
    label_columns = ["label"]
    weight_column = None
    task_names, task_kinds = ["label"], ["binary"]
    dense_names = DENSE_NAMES
    sparse_names = SPARSE_NAMES
    sequence_names: list[str] = []
    spec = None
    transforms = {
        "label": "float32",
        "dense": "log1p(max(x, 0)) as float32; empty -> 0",
        "sparse": "id = 1 + uint32(hex) mod (num_embeddings - 1) as int64; empty -> 0",
        "key": "the 8 hex digits as an unsigned 32-bit integer",
    }

    @staticmethod
    def count_rows(path: str | os.PathLike) -> int:
        return count_rows(path)

    def read_chunks(self, path: str, skipped: list | None = None, max_rows: int | None = None):
        return read_chunks(path, skipped, self.labelled, max_rows, self.short_lines)

    @staticmethod
    def bad_row_mask(batch: pa.RecordBatch):
        return bad_row_mask(batch)

    @staticmethod
    def parse_batch(batch: pa.RecordBatch, path: str, first_row: int):
        return parse_batch(batch, path, first_row)

    @staticmethod
    def weights(batch: pa.RecordBatch, path: str, first_row: int) -> np.ndarray:
        """Never called: ``weight_column`` is None (no sample weights in criteo_tsv)."""
        raise NotImplementedError("criteo_tsv has no sample-weight column")

    @staticmethod
    def output_schema() -> pa.Schema:
        return output_schema()

    def unlabelled(self, path: str | os.PathLike) -> CriteoFormat | None:
        """The 39-field layout of Kaggle's test.txt when the file's first line has 39 fields."""
        if not self.labelled or first_line_fields(str(path)) != NUM_DENSE + NUM_SPARSE:
            return None
        return CriteoFormat(labelled=False, short_lines=self.short_lines)

    def request_layout(self) -> RequestLayout:
        """Request rows: columns ``label`` (optional, ignored), ``I1..I13`` (integers), ``C1..C26``
        (hex text); a text line holds 39 tab-separated fields (no label) or 40 (label first).
        Written as Kaggle's 39-field test layout (``rows.txt``, read back unlabelled); in memory the
        table gets the placeholder label "0". A value may not hold a tab (no quoting)."""
        return RequestLayout(
            columns=COLUMNS[1:],
            ignored=["label"],
            forbidden={"\t": "a tab"},
            placeholder_values={"label": "0"},
            listing="label, I1..I13, C1..C26",
            write=partial(write_delimited, name="rows.txt", columns=COLUMNS[1:], delimiter="\t", header=False),
            reader=lambda: self,  # reads no state
            stateful=False,
        )


CRITEO = CriteoFormat()


@register_format("criteo_tsv")
def _criteo(schema, short_lines: str = "error") -> CriteoFormat:
    return CRITEO if short_lines == "error" else CriteoFormat(short_lines=short_lines)


def first_line_fields(path: str) -> int:
    """Tab-separated fields on the first line of a (gzip / bz2 detected) file; 0 if empty."""
    head = read_head(path, 1 << 16)
    if b"\n" not in head and len(head) == 1 << 16:  # a longer first line: all of it (cut, it had fewer fields)
        head = read_head(path, BLOCK_BYTES)
    line = head.split(b"\n", 1)[0]
    return line.count(b"\t") + 1 if line else 0
