"""Several raw files, each all one split, converted in worker processes (one file each)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from recsys_dist.data.convert.passes import Reader, Totals, Transform, convert_rows, in_line_order, rows_skipped
from recsys_dist.data.convert.writer import SplitWriter, unlink_all
from recsys_dist.data.splits import SPLITS
from recsys_dist.data.workers import OrderedPool, WorkerDied
from recsys_dist.errors import DataError


class SourceJob:
    """One raw file whose rows all go to one split, converted to its own Parquet file (run in
    a worker process, see :func:`convert_in_workers`)."""

    def __init__(self, reader: Reader, transform: Transform, schema: pa.Schema, row_group_size: int) -> None:
        self.reader, self.transform, self.schema, self.row_group_size = reader, transform, schema, row_group_size

    def __call__(self, path: str, fixed: int, out_path: str) -> tuple[int, Totals]:
        r = self.reader
        skipped: list | None = None if r.skipped is None else []
        reader = Reader(r.fmt, path, r.split, fixed, r.cap, r.bounds, skipped)
        writer = SplitWriter(Path(out_path), self.schema, self.row_group_size)
        try:
            totals = convert_rows([reader], {SPLITS[fixed]: writer}, self.transform)
        except BaseException:
            writer.discard()
            raise
        writer.close()
        if skipped is not None:
            totals.n_skipped = rows_skipped(skipped, [reader])
            totals.examples = [
                {"file": Path(path).name, "line": ln, "reason": why} for ln, why in in_line_order(skipped)[:20]
            ]
        return writer.rows, totals


def convert_in_workers(
    readers: list[Reader],
    out: Path,
    transform: Transform,
    schema: pa.Schema,
    row_group_size: int,
    progress: bool,
    token: str,
) -> tuple[Totals, dict, dict, dict]:
    """Several raw files, each all one split (``split.by: files`` with several training files):
    each file is converted in a worker process to its own Parquet file, ``<split>.parquet``
    when the split has one file, else ``<split>-00000.parquet``, ... in the order given.
    Returns the totals, rows and file names per split, and the temporary paths (renamed by
    the caller once everything is written; ``token`` makes them this process's own)."""
    per_split = {s: [r for r in readers if SPLITS[r.fixed] == s] for s in SPLITS}
    names = {
        s: [f"{s}.parquet"] if len(rs) == 1 else [f"{s}-{i:05d}.parquet" for i in range(len(rs))]
        for s, rs in per_split.items()
    }
    tmp = {s: [out / f".{n}.{token}.tmp" for n in names[s]] for s in SPLITS}
    jobs = [(r.path, r.fixed, str(tmp[s][i])) for s in SPLITS for i, r in enumerate(per_split[s])]
    totals, rows = Totals.of(transform), dict.fromkeys(SPLITS, 0)
    bar = tqdm(total=len(jobs), unit="file", desc=f"convert {len(jobs)} files", disable=not progress)
    try:
        with OrderedPool(
            min(len(jobs), os.cpu_count() or 1), SourceJob(readers[0], transform, schema, row_group_size)
        ) as pool:
            for (_, fixed, _), (n, t) in pool.map(jobs):
                rows[SPLITS[fixed]] += n
                totals.add(t)
                bar.update(1)
    except WorkerDied as err:
        unlink_all(tmp)
        raise DataError(f"converting {len(jobs)} files: {err}") from None
    except BaseException:
        unlink_all(tmp)
        raise
    bar.close()
    return totals, rows, names, tmp
