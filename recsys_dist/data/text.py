"""Delimited text files read in bounded memory: blocks of whole lines, parsed into tables of
text columns, with every bad line (not UTF-8, blank, an unclosed quote, a lone carriage
return, a wrong field count) named by file and line or, under ``on_bad_row: skip``, left out
and recorded. The formats (``recsys_dist.data.formats``) read their files through this module.

Memory: one pyarrow block (``BLOCK_BYTES`` of text) is in flight at a time, whatever the file
size (docs/design/0008-bounded-memory-conversion-and-batch-layout-loader.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recsys_dist.errors import DataError

BLOCK_BYTES = 8 << 20
LINE_COLUMN = "__line__"  # under on_bad_row: skip, the file line of each parsed row
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, dropped from the start of a file

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
    if data.size != 8 * len(padded):  # a non-ASCII character pads to more than 8 bytes
        i = int(np.flatnonzero(np.diff(offsets) != 8)[0])
        raise DataError(f"{where}, line {first_row + i}: '{col[i].as_py()}' is not an 8-digit hex id")
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


# A decimal integer: optional sign, leading zeros, at most 18 more digits (|x| < 10^18, so
# int64 never overflows), spaces around it. The same definition on both parsing paths.
INT_PATTERN = r"^\s*[-+]?0*[0-9]{1,18}\s*$"
INT_LIMIT = 10**18


def parse_ints(col: pa.Array, where: str, first_row: int) -> pa.Array:
    """Decimal text -> int64 (empty -> null). Raises DataError naming the line of a bad value.
    A column the CSV reader already parsed as integers is returned as int64."""
    if pa.types.is_integer(col.type):
        return col.cast(pa.int64())
    col = pc.fill_null(col, "")
    ok = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, INT_PATTERN))
    if not pc.all(ok).as_py():
        i = int(np.flatnonzero(~ok.to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{where}, line {first_row + i}: '{col[i].as_py()}' is not an integer")
    # A leading "+" is allowed (the pattern above) but not by the cast: drop it.
    return pc.cast(pc.utf8_ltrim(pc.utf8_trim_whitespace(pc.if_else(pc.equal(col, ""), None, col)), "+"), pa.int64())


class BadRows:
    """Collects rows with the wrong number of fields (pyarrow calls it per bad row)."""

    def __init__(self) -> None:
        self.rows: list = []

    def __call__(self, row) -> str:
        self.rows.append(row)
        return "skip"


_SKIP_HINT = "fix or remove it, or set data.on_bad_row: skip to leave such lines out and count them"


class BadLine(DataError):
    """The first bad line of a block (``data.on_bad_row: error``). ``line``: its file line (None
    when pyarrow did not tell it); ``rows_before``: the block's rows before it (a table of text
    columns, or None), which :func:`rows_then_bad_line` hands on before raising, so that a
    rejected value on an earlier line is reported first."""

    def __init__(self, message: str, line: int | None = None, rows_before: pa.Table | None = None) -> None:
        # Defaults: pickled (from a worker process), it is rebuilt from its message alone.
        super().__init__(message)
        self.line, self.rows_before = line, rows_before


def rows_then_bad_line(first_line: int, parse: Callable[[], pa.Table]) -> Iterator[tuple[int, pa.Table]]:
    """``(first_line, parse())``; when ``parse`` raises :class:`BadLine`, first the rows before
    that line (their values are checked by the caller, which reports an earlier bad value
    first), then the error. Every format's ``read_chunks`` reads its blocks through this."""
    try:
        table = parse()
    except BadLine as err:
        if err.rows_before is not None and err.rows_before.num_rows:
            yield first_line, err.rows_before
        raise
    yield first_line, table


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
    ``skipped`` the first bad line in file order (whatever its kind) stops with a
    :class:`BadLine` naming the file and line (and column where there is one); with
    ``skipped`` (a list) each is appended as ``(file line or None, reason)``, in line order,
    and left out.

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
    # Bad lines of every kind are found first, all of them, then reported: under error the
    # one of the lowest line (the kinds are found in turn, so the first found may be a later line).
    found: list = []  # (file line or None, reason, the error's message)
    block = _Block(chunk, path, first_line, names, delimiter, quote_char, found, column_types)
    block.drop_unreadable()
    parsed = block.parse(use_threads)
    table, bad = parsed if parsed is not None else (pa.table({n: pa.array([], pa.string()) for n in names}), BadRows())
    describe = describe or (lambda row: f"expected {row.expected_columns} fields, got {row.actual_columns}")
    if bad.rows and bad.rows[0].number is None and use_threads:
        table, bad = block.read(False)  # a threaded parse does not tell the line: once more on one thread
    for r in bad.rows:
        ln = None if r.number is None else first_line + _original(block.removed, r.number - 1)
        why = f"{r.actual_columns} fields, expected {r.expected_columns}"
        found.append((ln, why, f"{path}, {'a line' if ln is None else f'line {ln}'}: {describe(r)}"))
    row_lines = None
    if (skipped is not None or found) and table.num_rows and all(r.number is not None for r in bad.rows):
        # Each row's file line, so a value rejected later is reported by its line.
        row_lines = _row_lines(_num_lines(block.chunk), first_line, block.removed, [r.number - 1 for r in bad.rows])
        row_lines = row_lines if len(row_lines) == table.num_rows else None
    found.sort(key=lambda f: (f[0] is None, f[0] or 0))
    if skipped is None and found:
        line, _, message = found[0]
        before = None
        if line is not None and row_lines is not None:
            before = table.slice(0, int(np.searchsorted(row_lines, line)))
        raise BadLine(message, line, before)
    if skipped is not None:
        skipped += [(ln, why) for ln, why, _ in found]
        if row_lines is not None:
            table = table.append_column(LINE_COLUMN, pa.array(row_lines, pa.int64()))
    return table


class _Block:
    """The lines of one block as :func:`parse_block` cuts bad lines out of them: ``chunk`` (the
    lines left) and ``removed`` (indices in the original block of the lines cut out, sorted);
    each line cut out is recorded in ``found`` as (file line, reason, error message)."""

    def __init__(self, chunk, path, first_line, names, delimiter, quote_char, found, column_types) -> None:
        self.chunk, self.path, self.first_line, self.names = chunk, path, first_line, names
        self.delimiter, self.quote_char, self.found = delimiter, quote_char, found
        self.column_types = column_types or {}
        self.removed: list[int] = []

    def drop(self, found: list[tuple[int, str]]) -> None:
        """Record the bad lines ``found`` (indices in the block as it is now) and cut them out."""
        orig = [(_original(self.removed, i), why) for i, why in found]
        self.found.extend(
            (self.first_line + i, why, f"{self.path}, line {self.first_line + i}: {why}; {_SKIP_HINT}")
            for i, why in orig
        )
        chunk = self.chunk
        starts = _line_starts(chunk)
        gone = {i for i, _ in found}
        keep = [i for i in range(len(starts)) if i not in gone]
        self.removed[:] = sorted(set(self.removed) | {o for o, _ in orig})
        self.chunk = b"".join(
            chunk[int(starts[i]) : (int(starts[i + 1]) if i + 1 < len(starts) else len(chunk))] for i in keep
        )

    def drop_unreadable(self) -> None:
        """Lines that are not UTF-8 text, then blank lines."""
        try:
            self.chunk.decode("utf-8")
        except UnicodeDecodeError:
            self.drop(_non_utf8_lines(self.chunk))
        blank = _blank_lines(self.chunk)
        if blank.size:
            self.drop([(int(i), "blank line") for i in blank])

    def read(self, threads: bool) -> tuple[pa.Table, BadRows]:
        """The block parsed by pyarrow's CSV reader, and the rows of a wrong field count."""
        bad = BadRows()
        try:
            table = pacsv.read_csv(
                pa.py_buffer(self.chunk),
                read_options=pacsv.ReadOptions(column_names=self.names, use_threads=threads),
                parse_options=pacsv.ParseOptions(
                    delimiter=self.delimiter,
                    quote_char=self.quote_char,
                    ignore_empty_lines=False,
                    invalid_row_handler=bad,
                ),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: self.column_types.get(n, pa.string()) for n in self.names},
                    null_values=[""],
                    strings_can_be_null=False,
                ),
            )
        except pa.ArrowInvalid as err:
            raise DataError(f"{self.path}, from line {self.first_line}: {err}") from None
        return table, bad

    def parse(self, threads: bool) -> tuple[pa.Table, BadRows] | None:
        """Parse until every line is a row or a bad row, cutting out lines that split or join
        rows (an unclosed quote, a lone carriage return); None when no line is left."""
        for _ in range(3):
            if not self.chunk:
                return None
            table, bad = self.read(threads)
            n = _num_lines(self.chunk)
            if table.num_rows + len(bad.rows) == n:
                return table, bad
            found = _split_lines(self.chunk, self.names, self.delimiter, self.quote_char)
            if not found:
                raise DataError(
                    f"{self.path}, lines {self.first_line}..{self.first_line + n + len(self.removed) - 1}: "
                    f"{n} lines gave {table.num_rows + len(bad.rows)} rows (a field holding "
                    "a line break or an unclosed quote?)"
                )
            self.drop(found)
        raise DataError(f"{self.path}, from line {self.first_line}: lines and rows do not match")


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
