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

Splits: ``recsys_dist.data.splits``. Memory: one pyarrow block (``BLOCK_BYTES`` of
text) is in flight at a time, whatever the file size.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recsys_dist.data.mapping import SparseKeys, hash_ids
from recsys_dist.errors import DataError

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
COLUMNS = ["label"] + DENSE_NAMES + SPARSE_NAMES
SPLITS = ("train", "validation", "test")
BLOCK_BYTES = 8 << 20
LINE_COLUMN = "__line__"  # under on_bad_row: skip, the file line of each parsed row
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, dropped from the start of a file
TRANSFORM_VERSION = 1

_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def read_error(path, err: Exception) -> DataError:
    """A DataError for a raw file that cannot be read (e.g. a truncated gzip / bz2 stream)."""
    hint = (
        "; a compressed file may be truncated or corrupt: download or compress it again"
        if str(path).endswith((".gz", ".bz2", ".zst", ".lz4")) or "compress" in str(err)
        else ""
    )
    return DataError(f"{path}: cannot read the file ({err}){hint}")


def count_rows(path: str | os.PathLike) -> int:
    """Number of lines (a last line without newline counts too); gzip/bz2 are decompressed.

    Every line is a row or a bad row (blank lines included), so this is the rows read.

    Raises:
        DataError: the file cannot be read (e.g. a truncated compressed stream).
    """
    n, last = 0, b"\n"
    try:
        with pa.input_stream(str(path), compression="detect") as f:
            while chunk := f.read(1 << 24):
                n += chunk.count(b"\n")
                last = chunk[-1:]
    except (OSError, pa.ArrowInvalid) as err:
        raise read_error(path, err) from None
    return n + (last != b"\n")


def read_head(path: str | os.PathLike, n: int) -> bytes:
    """The first ``n`` bytes of a (gzip / bz2 detected) file, a UTF-8 byte order mark removed.

    Raises:
        DataError: the file cannot be read.
    """
    try:
        with pa.input_stream(str(path), compression="detect") as f:
            head = f.read(n + len(BOM))
    except (OSError, pa.ArrowInvalid) as err:
        raise read_error(path, err) from None
    return head[len(BOM) :] if head.startswith(BOM) else head[:n]


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
    padded = (
        pc.utf8_lpad(col, 8, "0").combine_chunks() if isinstance(col, pa.ChunkedArray) else pc.utf8_lpad(col, 8, "0")
    )
    offsets = np.frombuffer(padded.buffers()[1], dtype=np.int32, count=len(padded) + 1, offset=padded.offset * 4)
    data = np.frombuffer(padded.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    digits = _HEX[data.reshape(-1, 8)]
    present = lengths > 0
    if (digits == 255).any():  # per-row search only when something is wrong
        i = int(np.flatnonzero((digits == 255).any(axis=1))[0])
        raise DataError(f"{where}, line {first_row + i}: '{col[i].as_py()}' is not an 8-digit hex id")
    # Two hex digits make a byte; 4 bytes read big-endian are the 32-bit value (missing values
    # were padded to "00000000", so they come out 0). Bytes, not 8 uint64 shifts per row.
    packed = np.ascontiguousarray((digits[:, 0::2] << 4) | digits[:, 1::2])
    h = packed.view(">u4").ravel().astype(np.uint64)
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


# A decimal integer: optional sign, leading zeros, at most 18 more digits (|x| < 10^18, so
# int64 never overflows), spaces around it. The same definition on both parsing paths.
_INT = r"^\s*[-+]?0*[0-9]{1,18}\s*$"
_LABEL = r"^\s*(?:[-+]?0+|\+?0*1)\s*$"  # an integer (as _INT) equal to 0 or 1
_INT_TYPES = {n: pa.int64() for n in ["label", *DENSE_NAMES]}
_INT_LIMIT = 10**18


def bad_row_mask(batch: pa.RecordBatch) -> tuple[np.ndarray, list[str]]:
    """Which rows hold a value the transforms reject, and why (first reason per row).

    Returns a bool array [N] and, for the bad rows in order, "column X: 'value'" reasons.
    """
    bad = np.zeros(batch.num_rows, dtype=bool)
    reason = np.full(batch.num_rows, None, dtype=object)
    checks = (
        [("label", _LABEL, False)]
        + [(n, _INT, True) for n in DENSE_NAMES]
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


class _BadRows:
    """Collects rows with the wrong number of fields (pyarrow calls it per bad row)."""

    def __init__(self, labelled: bool = True) -> None:
        self.rows: list = []
        self.labelled = labelled

    def __call__(self, row) -> str:
        self.rows.append(row)
        return "skip"

    def describe(self, row) -> str:
        """What is wrong with a Criteo row of the wrong field count, with a hint."""
        short = f"; {_SHORT_HINT}" if row.actual_columns < row.expected_columns else ""
        if not self.labelled:
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


_SKIP_HINT = "fix or remove it, or set data.on_bad_row: skip to leave such lines out and count them"


def _line_starts(chunk: bytes) -> np.ndarray:
    """Byte offset of each line of ``chunk`` (int64 [lines])."""
    arr = np.frombuffer(chunk, dtype=np.uint8)
    starts = np.concatenate([[0], np.flatnonzero(arr == 10) + 1])
    return starts[starts < len(chunk)]


def _num_lines(chunk: bytes) -> int:
    return chunk.count(b"\n") + (1 if chunk and not chunk.endswith(b"\n") else 0)


def _lines(chunk: bytes, starts: np.ndarray, idx) -> Iterator[tuple[int, bytes]]:
    """(index, text without the line end) of the lines ``idx`` of ``chunk``."""
    for i in idx:
        end = int(starts[i + 1]) if i + 1 < len(starts) else len(chunk)
        yield int(i), chunk[int(starts[i]) : end].rstrip(b"\n").rstrip(b"\r")


def _non_utf8_lines(chunk: bytes) -> list[tuple[int, str]]:
    """(line index, reason) of every line of ``chunk`` that is not UTF-8 text."""
    out, pos = [], 0
    while True:
        try:
            chunk[pos:].decode("utf-8")
            return out
        except UnicodeDecodeError as err:
            bad = pos + err.start
        line_start = chunk.rfind(b"\n", 0, bad) + 1
        out.append((chunk.count(b"\n", 0, bad), f"byte {bad - line_start + 1} (0x{chunk[bad]:02x}) is not UTF-8 text"))
        nxt = chunk.find(b"\n", bad)
        if nxt < 0:
            return out
        pos = nxt + 1


_BLANK = re.compile(rb"\n\r?\n")


def _blank_lines(chunk: bytes) -> np.ndarray:
    """Indices of the empty lines of ``chunk`` (``\\n`` or ``\\r\\n`` alone)."""
    if not (chunk.startswith((b"\n", b"\r\n")) or _BLANK.search(chunk)):
        return np.zeros(0, dtype=np.int64)
    arr = np.frombuffer(chunk, dtype=np.uint8)
    starts = _line_starts(chunk)
    first = arr[starts]
    second = arr[np.minimum(starts + 1, len(arr) - 1)]
    return np.flatnonzero((first == 10) | ((first == 13) & (second == 10)))


def _open_quote_field(line: bytes, delimiter: int, quote: int) -> int | None:
    """Index of the field whose quotes are still open at the end of ``line`` (as pyarrow parses
    it: a field is quoted if it starts with the quote character, ``""`` inside is a quote)."""
    field, i, n, at_start, in_quotes, opened = 0, 0, len(line), True, False, None
    while i < n:
        c = line[i]
        if in_quotes:
            if c == quote:
                if i + 1 < n and line[i + 1] == quote:
                    i += 2
                    continue
                in_quotes = False
        elif c == delimiter:
            field, at_start, i = field + 1, True, i + 1
            continue
        elif at_start and c == quote:
            in_quotes, opened = True, field
        at_start = False
        i += 1
    return opened if in_quotes else None


def _split_lines(chunk: bytes, names: list[str], delimiter: str, quote_char) -> list[tuple[int, str]]:
    """(line index, reason) of the lines that do not parse as one row each: a quoted field
    running past the line end (an unclosed quote), or a lone carriage return inside a line."""
    out = []
    starts = _line_starts(chunk)
    if quote_char:
        q = ord(quote_char)
        cand = (
            [i for i, line in _lines(chunk, starts, range(len(starts))) if q in line]
            if chunk.count(quote_char.encode())
            else []
        )
        for i, line in _lines(chunk, starts, cand):
            field = _open_quote_field(line, ord(delimiter), q)
            if field is not None:
                col = names[field] if field < len(names) else f"field {field + 1}"
                out.append(
                    (
                        i,
                        f"column {col}: a quoted field is not closed on this line "
                        f"(a field cannot hold a line break; close or remove the {quote_char})",
                    )
                )
    for pos in (m.start() for m in re.finditer(rb"\r(?!\n)", chunk)):
        i = int(np.searchsorted(starts, pos, side="right") - 1)
        if not any(i == j for j, _ in out):
            out.append((i, "a carriage return (\\r) inside the line splits it in two"))
    return sorted(out)


def parse_block(
    chunk: bytes,
    path: str,
    first_line: int,
    names: list[str],
    *,
    delimiter: str = "\t",
    quote_char=False,
    header: bool = False,
    skipped: list | None = None,
    describe=None,
    use_threads: bool = True,
    column_types: dict | None = None,
) -> pa.Table:
    """One block of whole lines (from :func:`line_blocks`) -> a table of text columns.

    Every line is a row or a bad line, so rows read = rows parsed + bad lines. Bad lines: a
    line that is not UTF-8 text, a blank line, a quoted field not closed on its line (it would
    swallow the lines after it), a lone carriage return, a wrong field count. Without
    ``skipped`` the first bad line stops with a :class:`DataError` naming the file and line
    (and column where there is one); with ``skipped`` (a list) each is appended as ``(file
    line or None, reason)`` and left out.

    Args:
        first_line: file line number (1-based) of the block's first line.
        header: the block's first line is a header line, not data.
        column_types: pyarrow types of some columns (the rest are text); an empty field is
            null there. A value that does not convert is a DataError "from line N", without
            the line: callers parse such a block again as text to find it.
        describe: ``row -> str`` for a row with the wrong field count (pyarrow's InvalidRow).
    """
    if header:
        cut = chunk.find(b"\n") + 1 if b"\n" in chunk else len(chunk)
        chunk, first_line = chunk[cut:], first_line + 1
    removed: list[int] = []  # line indices of the block dropped under skip (sorted)

    def drop(found: list[tuple[int, str]]) -> bytes:
        """Report the first bad line, or (skip) record them all and cut them out of the block."""
        orig = [(_original(removed, i), why) for i, why in found]
        if skipped is None:
            i, why = min(orig)
            raise DataError(f"{path}, line {first_line + i}: {why}; {_SKIP_HINT}")
        skipped.extend((first_line + i, why) for i, why in orig)
        starts = _line_starts(chunk)
        gone = {i for i, _ in found}
        keep = [i for i in range(len(starts)) if i not in gone]
        removed[:] = sorted(set(removed) | {o for o, _ in orig})
        return b"".join(
            chunk[int(starts[i]) : (int(starts[i + 1]) if i + 1 < len(starts) else len(chunk))] for i in keep
        )

    try:
        chunk.decode("utf-8")
    except UnicodeDecodeError:
        chunk = drop(_non_utf8_lines(chunk))
    blank = _blank_lines(chunk)
    if blank.size:
        chunk = drop([(int(i), "blank line") for i in blank])
    describe = describe or (lambda row: f"expected {row.expected_columns} fields, got {row.actual_columns}")

    def read(threads: bool) -> tuple[pa.Table, _BadRows]:
        bad = _BadRows()
        try:
            table = pacsv.read_csv(
                pa.py_buffer(chunk),
                read_options=pacsv.ReadOptions(column_names=names, use_threads=threads),
                parse_options=pacsv.ParseOptions(
                    delimiter=delimiter, quote_char=quote_char, ignore_empty_lines=False, invalid_row_handler=bad
                ),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: (column_types or {}).get(n, pa.string()) for n in names},
                    null_values=[""],
                    strings_can_be_null=False,
                ),
            )
        except pa.ArrowInvalid as err:
            raise DataError(f"{path}, from line {first_line}: {err}") from None
        return table, bad

    for _ in range(3):
        if not chunk:
            return pa.table({n: pa.array([], pa.string()) for n in names})
        table, bad = read(use_threads)
        if table.num_rows + len(bad.rows) == _num_lines(chunk):
            break
        found = _split_lines(chunk, names, delimiter, quote_char)
        if not found:
            raise DataError(
                f"{path}, lines {first_line}..{first_line + _num_lines(chunk) + len(removed) - 1}: "
                f"{_num_lines(chunk)} lines gave {table.num_rows + len(bad.rows)} rows (a field holding "
                "a line break or an unclosed quote?)"
            )
        chunk = drop(found)
    else:
        raise DataError(f"{path}, from line {first_line}: lines and rows do not match")
    if bad.rows:
        if bad.rows[0].number is None and use_threads:
            table, bad = read(False)  # a threaded parse does not tell the line: once more on one thread
        lines = [None if r.number is None else first_line + _original(removed, r.number - 1) for r in bad.rows]
        if skipped is None:
            raise DataError(f"{path}, {'a line' if lines[0] is None else f'line {lines[0]}'}: {describe(bad.rows[0])}")
        skipped += [(ln, f"{r.actual_columns} fields, expected {r.expected_columns}") for ln, r in zip(lines, bad.rows)]
    if skipped is not None and table.num_rows and all(r.number is not None for r in bad.rows):
        # Under skip, each row's file line, so a value rejected later is reported by its line.
        lines = _row_lines(_num_lines(chunk), first_line, removed, [r.number - 1 for r in bad.rows])
        if len(lines) == table.num_rows:
            table = table.append_column(LINE_COLUMN, pa.array(lines, pa.int64()))
    return table


def _row_lines(n_lines: int, first_line: int, removed: list[int], invalid: list[int]) -> np.ndarray:
    """File lines of the rows of a block of ``n_lines`` lines, once ``invalid`` of them (indices
    in the block as parsed) gave no row, after ``removed`` (indices in the original block)
    were cut out of it."""
    kept = np.setdiff1d(np.arange(n_lines), np.asarray(invalid, dtype=np.int64))
    original = np.setdiff1d(np.arange(n_lines + len(removed)), np.asarray(removed, dtype=np.int64))
    return first_line + original[kept]


def _original(removed: list[int], i: int) -> int:
    """Line index in the original block of line ``i`` of a block with lines ``removed`` cut out."""
    for r in removed:
        if r <= i:
            i += 1
        else:
            break
    return i


def pad_short_lines(chunk: bytes, fields: int) -> bytes:
    """``chunk`` with a tab appended to each non-blank line of fewer than ``fields``
    tab-separated fields for every absent field (before a ``\r\n`` line end), so the absent
    trailing fields read as empty. Lines with enough fields, blank lines and line numbers are
    unchanged."""
    arr = np.frombuffer(chunk, dtype=np.uint8)
    ends = np.flatnonzero(arr == 10)
    if not chunk.endswith(b"\n"):
        ends = np.append(ends, len(chunk))
    starts = np.concatenate([[0], ends[:-1] + 1])
    tabs = np.diff(np.concatenate([[0], np.searchsorted(np.flatnonzero(arr == 9), ends)]))
    content_end = ends - ((ends > starts) & (arr[np.maximum(ends - 1, 0)] == 13))  # before a \r
    short = np.flatnonzero((tabs < fields - 1) & (content_end > starts))
    if not short.size:
        return chunk
    pieces, prev = [], 0
    for i in short:
        e = int(content_end[i])
        pieces += [chunk[prev:e], b"\t" * int(fields - 1 - tabs[i])]
        prev = e
    pieces.append(chunk[prev:])
    return b"".join(pieces)


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
    # text columns to convert later). Its integers are a superset of ours (_INT): it also
    # reads hex ("0x10") and 19 digits. So a block with an "x" anywhere, with a value of 10^18
    # or more, or with a value it cannot convert, is parsed again as text, which applies _INT
    # and names the line and column of a bad value (or skips its row).
    table = None
    if b"x" not in chunk and b"X" not in chunk:
        found: list | None = None if skipped is None else []
        try:
            table = parse_block(
                chunk,
                path,
                first_line,
                columns,
                delimiter="\t",
                skipped=found,
                describe=_BadRows(labelled).describe,
                use_threads=use_threads,
                column_types=_INT_TYPES,
            )
        except DataError:
            table = None
        if table is not None and not _ints_in_range(table):
            table = None
        if table is not None and skipped is not None:
            skipped.extend(found)
    if table is None:
        table = parse_block(
            chunk,
            path,
            first_line,
            columns,
            delimiter="\t",
            skipped=skipped,
            describe=_BadRows(labelled).describe,
            use_threads=use_threads,
        )
    if not labelled:  # Kaggle test layout: a placeholder label, reported as missing by score()
        table = table.add_column(0, "label", pa.array(np.full(table.num_rows, "0")))
    return table


def _ints_in_range(table: pa.Table) -> bool:
    """Every integer column of ``table`` (parsed by the CSV reader) within +-(10^18 - 1)."""
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_integer(col.type) and col.length() - col.null_count:
            mm = pc.min_max(col).as_py()
            if mm["min"] <= -_INT_LIMIT or mm["max"] >= _INT_LIMIT:
                return False
    return True


def line_blocks(path: str, max_lines: int | None = None) -> Iterator[bytes]:
    """The file (gzip / bz2 detected) in blocks of about ``BLOCK_BYTES``, each cut after a
    line end, so only one block is in memory at a time. A UTF-8 byte order mark at the start
    is dropped. ``max_lines``: stop after that many lines (the rest is never looked at).

    Raises:
        DataError: the file cannot be read (e.g. a truncated compressed stream).
    """
    carry, first, lines = b"", True, 0
    try:
        f = pa.input_stream(path, compression="detect")
    except (OSError, pa.ArrowInvalid) as err:
        raise read_error(path, err) from None
    with f:
        while True:
            try:
                block = f.read(BLOCK_BYTES)
            except (OSError, pa.ArrowInvalid) as err:
                raise read_error(path, err) from None
            if first and block.startswith(BOM):
                block = block[len(BOM) :]
            first = False
            data = carry + block
            if not data:
                return
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if cut == 0:  # a line longer than a block: keep reading
                carry = data
                continue
            out, carry = data[:cut], data[cut:]
            if max_lines is not None:
                n = out.count(b"\n") + (not out.endswith(b"\n"))
                if lines + n >= max_lines:
                    yield _first_lines(out, max_lines - lines)
                    return
                lines += n
            yield out
            if not block:
                return


def _first_lines(block: bytes, n: int) -> bytes:
    """The first ``n`` lines of ``block`` (with their line ends)."""
    end = -1
    for _ in range(n):
        end = block.find(b"\n", end + 1)
        if end < 0:
            return block
    return block[: end + 1]


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
        table = _parse_chunk(
            chunk, path, line, use_threads=True, skipped=skipped, labelled=labelled, short_lines=short_lines
        )
        yield line, table
        line += chunk.count(b"\n")


def parse_ints(col: pa.Array, where: str, first_row: int) -> pa.Array:
    """Decimal text -> int64 (empty -> null). Raises DataError naming the line of a bad value.
    A column the CSV reader already parsed as integers is returned as int64."""
    if pa.types.is_integer(col.type):
        return col.cast(pa.int64())
    col = pc.fill_null(col, "")
    ok = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, _INT))
    if not pc.all(ok).as_py():
        i = int(np.flatnonzero(~ok.to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{where}, line {first_row + i}: '{col[i].as_py()}' is not an integer")
    # A leading "+" is allowed (the pattern above) but not by the cast: drop it.
    return pc.cast(pc.utf8_ltrim(pc.utf8_trim_whitespace(pc.if_else(pc.equal(col, ""), None, col)), "+"), pa.int64())


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

    def read_chunks(self, path: str, skipped: list | None = None, max_rows: int | None = None):
        return read_chunks(path, skipped, self.labelled, max_rows, self.short_lines)

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
    line = read_head(path, 1 << 16).split(b"\n", 1)[0]
    return line.count(b"\t") + 1 if line else 0
