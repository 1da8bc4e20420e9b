"""Writing the converted splits: whole row groups per split file, temporary names until the
entry is complete, and the re-cut of position splits once skipped rows are known."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_dist.data.convert.passes import Totals
from recsys_dist.data.splits import SPLITS


class SplitWriter:
    """One split's Parquet file, written in whole row groups: batches wait until a full row
    group is there (writing each batch as it comes would give 65,536 + 3,712 + 65,536 + ...)."""

    def __init__(self, path: Path, schema: pa.Schema, row_group_size: int) -> None:
        self.path, self.row_group_size = path, row_group_size
        self.writer = pq.ParquetWriter(path, schema)
        self.pending: list = []
        self.rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self.pending.append(batch)
        self.rows += batch.num_rows
        self._flush()

    def _flush(self, force: bool = False) -> None:
        n = sum(b.num_rows for b in self.pending)
        if not self.pending or (n < self.row_group_size and not force):
            return
        table = pa.Table.from_batches(self.pending)
        full = n if force else n - n % self.row_group_size
        self.writer.write_table(table.slice(0, full), row_group_size=self.row_group_size)
        self.pending = table.slice(full).to_batches() if full < n else []

    def close(self) -> None:
        """Write what is pending and close the file."""
        self._flush(force=True)
        self.writer.close()

    def discard(self) -> None:
        self.writer.close()
        self.path.unlink(missing_ok=True)


def flat_paths(tmp: dict) -> list[Path]:
    return [t for v in tmp.values() for t in (v if isinstance(v, list) else [v])]


def unlink_all(tmp: dict) -> None:
    for t in flat_paths(tmp):
        t.unlink(missing_ok=True)


def recut_splits(
    tmp: dict, schema: pa.Schema, bounds: np.ndarray, row_group_size: int, totals: Totals
) -> tuple[dict, Totals]:
    """Rewrite the position splits in ``tmp`` (train, validation, test: consecutive runs of
    the kept rows) at ``bounds``; returns the rows per split and ``totals`` (empty) with the
    counts of the rows as written (training statistics and label counts, ids per split)."""
    writers = {s: SplitWriter(tmp[s].with_name(tmp[s].name + ".recut.tmp"), schema, row_group_size) for s in SPLITS}
    pos = 0
    try:
        for s in SPLITS:
            for batch in pq.ParquetFile(tmp[s]).iter_batches(batch_size=row_group_size):
                lo = pos
                pos += batch.num_rows
                for k, target in enumerate(SPLITS):
                    a, b = max(lo, int(bounds[k])), min(pos, int(bounds[k + 1]))
                    if a >= b:
                        continue
                    part = batch.slice(a - lo, b - a)
                    writers[target].add(part)
                    totals.add_part(k, part)
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    for s in SPLITS:
        os.replace(writers[s].path, tmp[s])
    return {s: w.rows for s, w in writers.items()}, totals
