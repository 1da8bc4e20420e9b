"""Raw file -> train / validation / test Parquet, streamed in bounded memory, cached.

Format-independent: a format object (``criteo.CRITEO``, ``avazu.AVAZU``) reads chunks of
text columns, finds bad rows and transforms a chunk to its output schema; this module
splits rows by position, writes full-size row groups, and writes the manifest last.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from recsys_dist.data.criteo import BLOCK_BYTES, SPLITS, TRANSFORM_VERSION, DataError


@dataclass(frozen=True)
class PreparedData:
    """Paths of the converted splits and the manifest written beside them."""

    directory: Path
    files: dict[str, Path]
    rows: dict[str, int]


def _fingerprint(raw: Path, sizes: list[int], num_rows: int | None, split: tuple, on_bad_row: str,
                 fmt_name: str) -> str:
    st = raw.stat()
    key = json.dumps([str(raw.resolve()), st.st_size, st.st_mtime_ns, sizes, num_rows, list(split), TRANSFORM_VERSION]
                     + ([on_bad_row] if on_bad_row != "error" else [])
                     + ([fmt_name] if fmt_name != "criteo_tsv" else []))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("RECSYS_DIST_CACHE", Path.home() / ".cache" / "recsys_dist"))


def prepare(
    fmt,
    raw_path: str | os.PathLike,
    num_embeddings: int | list[int],
    split: tuple[float, float, float] = (0.8, 0.1, 0.1),
    num_rows: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    row_group_size: int = 65536,
    on_bad_row: str = "error",
    progress: bool = False,
) -> PreparedData:
    """Convert a raw file of format ``fmt`` to train/validation/test Parquet once, then reuse it.

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
    dense_names, sparse_names = list(fmt.dense_names), list(fmt.sparse_names)
    num_dense = len(dense_names)
    sizes = num_embeddings if isinstance(num_embeddings, list) else [num_embeddings] * len(sparse_names)
    if len(sizes) != len(sparse_names):
        raise ValueError(f"num_embeddings: {len(sizes)} sizes for {len(sparse_names)} features of {fmt.name}")
    out = Path(cache_dir) if cache_dir else default_cache_dir()
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    prefix = "criteo" if fmt.name == "criteo_tsv" else fmt.name
    out = out / f"{prefix}-{_fingerprint(raw, sizes, num_rows, tuple(split), on_bad_row, fmt.name)}"
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        m = json.loads(manifest_path.read_text())
        return PreparedData(out, {s: out / f"{s}.parquet" for s in SPLITS}, m["rows"])

    total = fmt.count_rows(raw)
    if num_rows is not None:
        total = min(total, num_rows)
    if total == 0:
        raise DataError(f"{raw}: the file holds no rows")
    bounds = np.floor(np.cumsum([0.0, *split]) * total + 1e-9).astype(int)
    bounds[-1] = total
    out.mkdir(parents=True, exist_ok=True)
    tmp = {s: out / f".{s}.parquet.tmp" for s in SPLITS}
    writers = {s: pq.ParquetWriter(tmp[s], fmt.output_schema()) for s in SPLITS}
    rows = dict.fromkeys(SPLITS, 0)
    seen = 0
    pending: dict = {s: [] for s in SPLITS}  # batches not yet written, so row groups are full-size

    def flush(split: str, force: bool = False) -> None:
        if pending[split] and (force or sum(b.num_rows for b in pending[split]) >= row_group_size):
            writers[split].write_table(pa.Table.from_batches(pending[split]), row_group_size=row_group_size)
            pending[split] = []

    skipped: list | None = [] if on_bad_row == "skip" else None
    n_skipped_values = 0
    stats = np.zeros((3, num_dense))  # train split: count, sum, sum of squares (transformed)
    missing = np.zeros(num_dense)
    bar = tqdm(total=raw.stat().st_size, unit="B", unit_scale=True, desc=f"convert {raw.name}",
               disable=not progress)
    try:
        for first_line, table in fmt.read_chunks(str(raw), skipped):
            bar.update(min(BLOCK_BYTES, bar.total - bar.n))
            for batch in table.combine_chunks().to_batches():
                if seen >= total:
                    break
                batch = batch.slice(0, total - seen)
                if skipped is not None:
                    bad, reasons = fmt.bad_row_mask(batch)
                    if bad.any():
                        for i, why in zip(np.flatnonzero(bad)[:20], reasons[:20]):
                            skipped.append((None, f"row {seen + int(i) + 1}: {why}"))
                        n_skipped_values += int(bad.sum())
                        batch = batch.filter(pa.array(~bad))
                        total -= int(bad.sum())
                        bounds = np.minimum(bounds, total)
                for j, n in enumerate(dense_names):
                    missing[j] += pc.sum(pc.equal(pc.fill_null(batch.column(n), ""), "")).as_py() or 0
                batch = fmt.transform_batch(batch, sizes, str(raw), first_row=seen + 1)
                train_part = max(0, min(bounds[1], seen + batch.num_rows) - seen)
                if train_part and num_dense:
                    dense = np.stack([batch.column(n).to_numpy()[:train_part] for n in dense_names], axis=1)
                    stats += [np.full(num_dense, train_part), dense.sum(0), (dense.astype(np.float64) ** 2).sum(0)]
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
        "format": fmt.name,
        "rows": rows,
        "num_embeddings": sizes,
        "dense": dense_names,
        "sparse": sparse_names,
        "transforms": fmt.transforms,
        "split": {"fractions": list(split), "order": "file order", "row_bounds": bounds.tolist()},
        "rows_written": seen,
        "rows_skipped": sum("fields" in why for _, why in skipped or []) + n_skipped_values,
        "skipped_examples": [{"line": ln, "reason": why} for ln, why in (skipped or [])[:20]],
        "dense_stats_train": {
            n: {"mean": float(stats[1, j] / stats[0, j]) if stats[0, j] else None,
                "std": float(np.sqrt(max(stats[2, j] / stats[0, j] - (stats[1, j] / stats[0, j]) ** 2, 0)))
                if stats[0, j] else None,
                "missing_fraction": float(missing[j] / seen) if seen else None}
            for j, n in enumerate(dense_names)
        },
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return PreparedData(out, {s: out / f"{s}.parquet" for s in SPLITS}, rows)
