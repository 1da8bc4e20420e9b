"""Criteo TSV (Kaggle DAC / 1TB click logs) to Parquet, streamed in bounded memory.

Raw layout: ``label, I1..I13, C1..C26``, tab-separated, no header, an empty field is
a missing value. Transforms (the same for every split):

- label: int in {0, 1} -> float32.
- dense ``I1..I13``: ``log1p(max(x, 0))`` as float32; empty -> 0.
- categorical ``C1..C26``: the 8-hex-digit value parsed as an unsigned 32-bit
  integer ``h``; id = ``1 + h mod (num_embeddings - 1)`` as int64; empty -> 0 (row 0
  of every table is reserved for "missing"). Ids are therefore always in
  ``[0, num_embeddings)``.

Rows are split in file order: the first ``split[0]`` fraction is train, the next
``split[1]`` validation, the rest test. Memory: one pyarrow block (``BLOCK_BYTES`` of
text) is in flight at a time, whatever the file size.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from tqdm import tqdm

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


def parse_hex_ids(col: pa.Array, num_embeddings: int, where: str, first_row: int) -> np.ndarray:
    """Hex strings -> int64 ids in ``[0, num_embeddings)``; empty or null -> 0.

    Args:
        col: pyarrow string array of 0..8 hex digits per value.
        num_embeddings: table rows (>= 2); row 0 is reserved for missing.
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
    ids = (1 + h % np.uint64(num_embeddings - 1)).astype(np.int64)
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


def transform_batch(batch: pa.RecordBatch, sizes: list[int], path: str, first_row: int) -> pa.RecordBatch:
    """One raw record batch -> the output schema (see module docstring)."""
    label = parse_ints(batch.column("label"), f"{path}, column label", first_row)
    if label.null_count:
        i = int(np.flatnonzero(label.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}, line {first_row + i}, column label: empty label")
    lab = label.to_numpy(zero_copy_only=False)
    if ((lab != 0) & (lab != 1)).any():
        i = int(np.flatnonzero((lab != 0) & (lab != 1))[0])
        raise DataError(f"{path}, line {first_row + i}, column label: {lab[i]} is not 0 or 1")
    arrays = [pa.array(lab.astype(np.float32))]
    arrays += [
        pa.array(transform_dense(parse_ints(batch.column(n), f"{path}, column {n}", first_row)))
        for n in DENSE_NAMES
    ]
    arrays += [
        pa.array(parse_hex_ids(batch.column(n), sizes[j], f"{path}, column {n}", first_row))
        for j, n in enumerate(SPARSE_NAMES)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=output_schema())


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

    def __init__(self) -> None:
        self.rows: list = []

    def __call__(self, row) -> str:
        self.rows.append(row)
        return "skip"

    def raise_first(self, path: str, line_offset: int = 0) -> None:
        if not self.rows:
            return
        row = self.rows[0]
        where = f"line {row.number + line_offset}" if row.number is not None else "a line"
        if row.actual_columns == NUM_DENSE + NUM_SPARSE:
            hint = (" (the label column seems missing; Kaggle's test.txt has this 39-field layout "
                    "and cannot be used for training)")
        else:
            hint = " (a Criteo row has 40 tab-separated fields: label, I1..I13, C1..C26)"
        raise DataError(
            f"{path}, {where}: expected {row.expected_columns} fields, got {row.actual_columns}{hint}"
        )


def _parse_chunk(chunk: bytes, path: str, first_line: int, use_threads: bool,
                 skipped: list | None = None) -> pa.Table:
    bad_rows = _BadRows()
    try:
        table = pacsv.read_csv(
            pa.py_buffer(chunk),
            read_options=pacsv.ReadOptions(column_names=COLUMNS, use_threads=use_threads),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, invalid_row_handler=bad_rows),
            convert_options=pacsv.ConvertOptions(
                column_types={n: pa.string() for n in COLUMNS}, strings_can_be_null=False
            ),
        )
    except pa.ArrowInvalid as err:
        raise DataError(f"{path}, from line {first_line}: {err}") from None
    if bad_rows.rows:
        if skipped is not None:
            skipped += [(None if r.number is None else r.number + first_line - 1,
                         f"{r.actual_columns} fields, expected {r.expected_columns}") for r in bad_rows.rows]
            return table
        if bad_rows.rows[0].number is None and use_threads:
            return _parse_chunk(chunk, path, first_line, use_threads=False)  # to learn the line
        bad_rows.raise_first(path, line_offset=first_line - 1)
    return table


def read_chunks(path: str, skipped: list | None = None) -> Iterator[tuple[int, pa.Table]]:
    """``(first line number, table of text columns)`` per ~``BLOCK_BYTES`` of the file.

    The file (gzip / bz2 detected) is read block by block and cut at line ends, and each
    block is parsed on all cores; only one block is in memory at a time. (pyarrow's own
    streaming reader reads ahead without bound: a 240 MB file held 215 MB of blocks.)
    Everything is kept as text so a bad value is reported with its line and column.
    With ``skipped`` (a list), rows with the wrong number of fields are appended to it as
    ``(line or None, reason)`` and left out instead of raising.
    """
    line = 1
    carry = b""
    with pa.input_stream(path, compression="detect") as f:
        while True:
            block = f.read(BLOCK_BYTES)
            data = carry + block
            if not data:
                return
            if block:
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # a line longer than a block: keep reading
                    carry = data
                    continue
                chunk, carry = data[:cut], data[cut:]
            else:
                chunk, carry = data, b""
            table = _parse_chunk(chunk, path, line, use_threads=True, skipped=skipped)
            yield line, table
            line += table.num_rows + (chunk.count(b"\n") - table.num_rows if skipped is not None else 0)
            if not block:
                return


def parse_ints(col: pa.Array, where: str, first_row: int) -> pa.Array:
    """Decimal text -> int64 (empty -> null). Raises DataError naming the line of a bad value."""
    col = pc.fill_null(col, "")
    ok = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, r"^\s*[-+]?[0-9]{1,18}\s*$"))
    if not pc.all(ok).as_py():
        i = int(np.flatnonzero(~ok.to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{where}, line {first_row + i}: '{col[i].as_py()}' is not an integer")
    return pc.cast(pc.utf8_trim_whitespace(pc.if_else(pc.equal(col, ""), None, col)), pa.int64())


@dataclass(frozen=True)
class PreparedData:
    """Paths of the converted splits and the manifest written beside them."""

    directory: Path
    files: dict[str, Path]
    rows: dict[str, int]


def _fingerprint(raw: Path, sizes: list[int], num_rows: int | None, split: tuple, on_bad_row: str) -> str:
    st = raw.stat()
    key = json.dumps([str(raw.resolve()), st.st_size, st.st_mtime_ns, sizes, num_rows, list(split), TRANSFORM_VERSION]
                     + ([on_bad_row] if on_bad_row != "error" else []))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("RECSYS_DIST_CACHE", Path.home() / ".cache" / "recsys_dist"))


def prepare_criteo(
    raw_path: str | os.PathLike,
    num_embeddings: int | list[int],
    split: tuple[float, float, float] = (0.8, 0.1, 0.1),
    num_rows: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    row_group_size: int = 65536,
    on_bad_row: str = "error",
    progress: bool = False,
) -> PreparedData:
    """Convert a Criteo TSV file to train/validation/test Parquet once, then reuse it.

    The output directory is keyed by the raw file (path, size, mtime), the table sizes,
    the row cap, the split and the bad-row policy, so changing any of them converts again.
    ``on_bad_row="skip"`` leaves out rows with a wrong field count or a rejected value and
    records them (rows read = rows written + rows skipped) in the manifest; ``"error"``
    stops at the first. ``progress`` shows a tqdm bar over the bytes read. Files are written
    under a temporary name and renamed, and ``manifest.json`` is written last, so an
    interrupted conversion is never mistaken for a finished one.

    Raises:
        DataError: malformed input (names the file, line and column), or no rows.
    """
    raw = Path(raw_path)
    if not raw.is_file():
        raise DataError(f"{raw}: {'is a directory, not a file' if raw.is_dir() else 'file does not exist'}")
    sizes = num_embeddings if isinstance(num_embeddings, list) else [num_embeddings] * NUM_SPARSE
    out = Path(cache_dir) if cache_dir else default_cache_dir()
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    out = out / f"criteo-{_fingerprint(raw, sizes, num_rows, tuple(split), on_bad_row)}"
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        m = json.loads(manifest_path.read_text())
        return PreparedData(out, {s: out / f"{s}.parquet" for s in SPLITS}, m["rows"])

    total = count_rows(raw)
    if num_rows is not None:
        total = min(total, num_rows)
    if total == 0:
        raise DataError(f"{raw}: the file holds no rows")
    bounds = np.floor(np.cumsum([0.0, *split]) * total + 1e-9).astype(int)
    bounds[-1] = total
    out.mkdir(parents=True, exist_ok=True)
    tmp = {s: out / f".{s}.parquet.tmp" for s in SPLITS}
    writers = {s: pq.ParquetWriter(tmp[s], output_schema()) for s in SPLITS}
    rows = dict.fromkeys(SPLITS, 0)
    seen = 0
    pending: dict = {s: [] for s in SPLITS}  # batches not yet written, so row groups are full-size

    def flush(split: str, force: bool = False) -> None:
        if pending[split] and (force or sum(b.num_rows for b in pending[split]) >= row_group_size):
            writers[split].write_table(pa.Table.from_batches(pending[split]), row_group_size=row_group_size)
            pending[split] = []

    skipped: list | None = [] if on_bad_row == "skip" else None
    n_skipped_values = 0
    stats = np.zeros((3, NUM_DENSE))  # train split: count, sum, sum of squares (transformed)
    missing = np.zeros(NUM_DENSE)
    bar = tqdm(total=raw.stat().st_size, unit="B", unit_scale=True, desc=f"convert {raw.name}",
               disable=not progress)
    try:
        for first_line, table in read_chunks(str(raw), skipped):
            bar.update(min(BLOCK_BYTES, bar.total - bar.n))
            for batch in table.combine_chunks().to_batches():
                if seen >= total:
                    break
                batch = batch.slice(0, total - seen)
                if skipped is not None:
                    bad, reasons = bad_row_mask(batch)
                    if bad.any():
                        for i, why in zip(np.flatnonzero(bad)[:20], reasons[:20]):
                            skipped.append((None, f"row {seen + int(i) + 1}: {why}"))
                        n_skipped_values += int(bad.sum())
                        batch = batch.filter(pa.array(~bad))
                        total -= int(bad.sum())
                        bounds = np.minimum(bounds, total)
                for j, n in enumerate(DENSE_NAMES):
                    missing[j] += pc.sum(pc.equal(pc.fill_null(batch.column(n), ""), "")).as_py() or 0
                batch = transform_batch(batch, sizes, str(raw), first_row=seen + 1)
                train_part = max(0, min(bounds[1], seen + batch.num_rows) - seen)
                if train_part:
                    dense = np.stack([batch.column(n).to_numpy()[:train_part] for n in DENSE_NAMES], axis=1)
                    stats += [np.full(NUM_DENSE, train_part), dense.sum(0), (dense.astype(np.float64) ** 2).sum(0)]
                for k, s in enumerate(SPLITS):
                    lo, hi = max(bounds[k], seen), min(bounds[k + 1], seen + batch.num_rows)
                    if hi > lo:
                        pending[s].append(batch.slice(lo - seen, hi - lo))
                        rows[s] += int(hi - lo)
                        flush(s)
                seen += batch.num_rows
            # pyarrow's allocator keeps freed blocks; hand them back so RSS tracks one block.
            pa.default_memory_pool().release_unused()
            if seen >= total:
                break
    except BaseException:
        for w in writers.values():
            w.close()
        for t in tmp.values():
            t.unlink(missing_ok=True)
        raise
    bar.close()
    for s in SPLITS:
        flush(s, force=True)
    for w in writers.values():
        w.close()
    if seen == 0:
        raise DataError(f"{raw}: no rows could be read" + (" (every row was skipped as bad)" if skipped else ""))
    for s in SPLITS:
        os.replace(tmp[s], out / f"{s}.parquet")
    manifest = {
        "source": str(raw.resolve()),
        "format": "criteo_tsv",
        "rows": rows,
        "num_embeddings": sizes,
        "dense": DENSE_NAMES,
        "sparse": SPARSE_NAMES,
        "transforms": {
            "label": "float32",
            "dense": "log1p(max(x, 0)) as float32; empty -> 0",
            "sparse": "id = 1 + uint32(hex) mod (num_embeddings - 1) as int64; empty -> 0",
        },
        "split": {"fractions": list(split), "order": "file order", "row_bounds": bounds.tolist()},
        "rows_written": seen,
        "rows_skipped": sum("fields" in why for _, why in skipped or []) + n_skipped_values,
        "skipped_examples": [{"line": ln, "reason": why} for ln, why in (skipped or [])[:20]],
        "dense_stats_train": {
            n: {"mean": float(stats[1, j] / stats[0, j]) if stats[0, j] else None,
                "std": float(np.sqrt(max(stats[2, j] / stats[0, j] - (stats[1, j] / stats[0, j]) ** 2, 0)))
                if stats[0, j] else None,
                "missing_fraction": float(missing[j] / seen) if seen else None}
            for j, n in enumerate(DENSE_NAMES)
        },
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return PreparedData(out, {s: out / f"{s}.parquet" for s in SPLITS}, rows)
