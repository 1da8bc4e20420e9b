"""Parquet -> rank-sharded CTR batches (dense tensor, KeyedJaggedTensor, labels, weights).

Every rank yields the same number of batches per epoch, each of exactly ``batch_size``
rows, so collective calls inside the sharded model (input_dist / output_dist all-to-all)
never wait on a rank that ran out of data.

Order and placement. An epoch is one stream of rows: the files' row groups, in a seeded
order per epoch, read in windows of at least ``shuffle_buffer_rows`` rows, each window
shuffled (seeded by seed, epoch and window). Global batch ``g`` is stream positions
``[g*B*W, (g+1)*B*W)`` and rank ``r`` takes the ``r``-th block of ``B`` rows. So the global
batches do not depend on the world size: 1 rank with batch 64 and 2 ranks with 32 train on
the same examples in the same steps. Every rank reads the stream but keeps only its rows;
memory is one window plus one batch, whatever the file sizes. When a split fits in one
window the order is a plain seeded permutation of all its rows.

Remainder. Rows after the last full global batch are either dropped (``drop``) or padded
(``pad``): padded rows repeat the rank's last row with ``weight == 0`` and never count in
loss or metrics; a rank whose slice is empty gets a batch of padding only.

KJT layout of a batch (keys C1..C26, B rows; multi-hot list columns give variable lengths)::

    values  = [C1 ids of rows 0..B-1, C2 ids of rows 0..B-1, ..., C26 ids of rows 0..B-1]  int64
    lengths = [ids per row for C1] + [... for C2] + ...                                     int32
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.criteo import DataError


@dataclass
class CTRBatch(Batch):
    """TorchRec ``Batch`` plus per-example weights.

    Attributes:
        dense_features: float32 [B, num_dense].
        sparse_features: KJT with int64 values, keys = the categorical feature names.
        labels: float32 [B] in {0, 1}.
        weights: float32 [B]; 1 for real rows, 0 for padding.
    """

    weights: torch.Tensor = None  # type: ignore[assignment]

    def to(self, device: torch.device, non_blocking: bool = False) -> "CTRBatch":
        return CTRBatch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            weights=self.weights.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        self.weights.record_stream(stream)

    def pin_memory(self) -> "CTRBatch":
        return CTRBatch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
            weights=self.weights.pin_memory(),
        )


def steps_per_epoch(num_rows: int, batch_size: int, world_size: int, remainder: str) -> int:
    """Global batches per epoch: rows / (batch_size x world_size), rounded up for "pad"."""
    per_step = batch_size * world_size
    return num_rows // per_step if remainder == "drop" else -(-num_rows // per_step)


class _Rows:
    """Columns of a set of rows: labels [n], dense [n, D], ``onehot`` int64 [n, K1] (the
    one-hot features, row-major so that shuffling gathers a row's ids in one read rather than
    one read per feature), ``multi``: per multi-hot feature (lengths [n], values)."""

    def __init__(self, labels, dense, onehot, multi) -> None:
        self.labels, self.dense, self.onehot, self.multi = labels, dense, onehot, multi
        self._offsets = [np.concatenate([[0], np.cumsum(lens)]) for lens, _ in multi]

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, idx: np.ndarray) -> "_Rows":
        multi = []
        for (lengths, values), offsets in zip(self.multi, self._offsets):
            sel = lengths[idx]
            starts = np.repeat(offsets[idx], sel)
            within = np.arange(sel.sum()) - np.repeat(np.cumsum(sel) - sel, sel)
            multi.append((sel, values[starts + within]))
        return _Rows(self.labels[idx], self.dense[idx], self.onehot[idx], multi)

    def slice(self, lo: int, hi: int) -> "_Rows":
        """Rows ``lo..hi-1`` as views (no copy)."""
        multi = [(lens[lo:hi], vals[off[lo]:off[hi]]) for (lens, vals), off in zip(self.multi, self._offsets)]
        return _Rows(self.labels[lo:hi], self.dense[lo:hi], self.onehot[lo:hi], multi)

    @staticmethod
    def concat(parts: list["_Rows"]) -> "_Rows":
        parts = [p for p in parts if len(p)] or parts[:1]
        if len(parts) == 1:
            return parts[0]
        multi = [(np.concatenate([p.multi[j][0] for p in parts]), np.concatenate([p.multi[j][1] for p in parts]))
                 for j in range(len(parts[0].multi))]
        return _Rows(np.concatenate([p.labels for p in parts]), np.concatenate([p.dense for p in parts]),
                     np.concatenate([p.onehot for p in parts]), multi)


class ParquetBatchLoader:
    """Batches of one Parquet split (one or several files) for one rank.

    Args:
        path: Parquet file or files with ``label`` (float), dense float and sparse int64
            (one-hot) or list<int64> (multi-hot) columns; all files must share one schema.
        batch_size: rows per batch on this rank.
        rank, world_size: this rank and the number of ranks.
        dense_names, sparse_names: column names, in model order.
        shuffle: new seeded order each epoch; identical on every rank and every rerun.
        seed: base seed.
        remainder: ``"pad"`` or ``"drop"`` (see module docstring).
        num_embeddings: per sparse feature; an id outside ``[0, n)`` raises DataError.
        shuffle_buffer_rows: rows read and shuffled together (memory bound).
        prefetch: batches prepared ahead by a background thread (0 = none).
        pin_memory: pin batches (for CUDA).

    Raises:
        DataError: a missing file or column, files with different schemas, no rows with
            ``drop``; while iterating, an id out of range or a non-finite dense value,
            naming the file, row and column.
    """

    def __init__(
        self,
        path: str | Sequence[str],
        batch_size: int,
        rank: int,
        world_size: int,
        dense_names: list[str],
        sparse_names: list[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        remainder: str = "pad",
        num_embeddings: Optional[list[int]] = None,
        shuffle_buffer_rows: int = 1 << 20,
        prefetch: int = 2,
        pin_memory: bool = False,
    ) -> None:
        if remainder not in ("pad", "drop"):
            raise ValueError(f"remainder must be 'pad' or 'drop', got {remainder!r}")
        self.files = [str(path)] if isinstance(path, (str, bytes)) or hasattr(path, "__fspath__") else [str(p) for p in path]
        self.dense_names, self.keys = list(dense_names), list(sparse_names)
        self.columns = ["label", *dense_names, *sparse_names]
        self.row_groups: list[tuple[int, int, int]] = []  # (file index, row group, rows)
        schema = None
        for i, f in enumerate(self.files):
            try:
                meta = pq.ParquetFile(f).metadata
            except (OSError, pa.ArrowInvalid) as err:
                raise DataError(f"{f}: cannot read as Parquet ({err})") from None
            file_schema = meta.schema.to_arrow_schema()
            missing = [c for c in self.columns if c not in file_schema.names]
            if missing:
                raise DataError(f"{f}: missing columns {missing}")
            picked = pa.schema([file_schema.field(c) for c in self.columns])
            if schema is not None and not picked.equals(schema):
                raise DataError(f"{f}: schema differs from {self.files[0]}: {picked} vs {schema}")
            schema = picked
            self.row_groups += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        self.list_features = [pa.types.is_list(schema.field(n).type) or pa.types.is_large_list(schema.field(n).type)
                              for n in sparse_names] if schema is not None else [False] * len(sparse_names)
        # Column of each feature in _Rows.onehot (one-hot) or index in _Rows.multi (multi-hot).
        counters = [0, 0]
        self._column = []
        for is_list in self.list_features:
            self._column.append(counters[is_list])
            counters[is_list] += 1
        self.num_rows = sum(n for *_, n in self.row_groups)
        self.path, self.batch_size, self.rank, self.world_size = self.files[0], batch_size, rank, world_size
        self.shuffle, self.seed, self.remainder = shuffle, seed, remainder
        self.num_embeddings, self.buffer_rows, self.prefetch = num_embeddings, shuffle_buffer_rows, prefetch
        self.pin_memory = pin_memory
        self.epoch = 0
        if len(self) == 0 and self.num_rows > 0:
            raise DataError(
                f"{self.path}: {self.num_rows} rows are fewer than one global batch "
                f"({batch_size} x {world_size} ranks) and data.remainder is 'drop'; use 'pad' or a smaller batch"
            )

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        return steps_per_epoch(self.num_rows, self.batch_size, self.world_size, self.remainder)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # ------------------------------------------------------------------ reading

    def _windows(self) -> list[list[int]]:
        """Row-group indices per window, in this epoch's order."""
        order = list(range(len(self.row_groups)))
        windows, cur, rows = [], [], 0
        for i in order:
            cur.append(i)
            rows += self.row_groups[i][2]
            if rows >= self.buffer_rows:
                windows.append(cur)
                cur, rows = [], 0
        if cur:
            windows.append(cur)
        if self.shuffle and len(windows) > 1:
            # Several windows: the row groups' order changes each epoch too.
            perm = np.random.default_rng([self.seed, self.epoch, 1]).permutation(len(self.row_groups))
            regrouped, cur, rows = [], [], 0
            for i in perm.tolist():
                cur.append(i)
                rows += self.row_groups[i][2]
                if rows >= self.buffer_rows:
                    regrouped.append(cur)
                    cur, rows = [], 0
            windows = regrouped + ([cur] if cur else [])
        return windows

    def _read(self, groups: list[int], first_row: int, handles: dict) -> _Rows:
        tables = []
        for i in groups:
            f, g, _ = self.row_groups[i]
            if f not in handles:  # opening a Parquet file costs more than reading a row group
                handles[f] = pq.ParquetFile(self.files[f])
            tables.append(handles[f].read_row_group(g, columns=self.columns))
        t = pa.concat_tables(tables)
        where = f"{self.files[self.row_groups[groups[0]][0]]}"
        labels = t.column("label").to_numpy().astype(np.float32)
        dense = np.stack([t.column(n).to_numpy().astype(np.float32) for n in self.dense_names], axis=1) \
            if self.dense_names else np.zeros((t.num_rows, 0), np.float32)
        bad = ~np.isfinite(dense)
        if bad.any():
            row, col = map(int, np.argwhere(bad)[0])
            raise DataError(f"{where}, row {first_row + row}, column {self.dense_names[col]}: "
                            f"{dense[row, col]} is not finite")
        onehot = np.empty((t.num_rows, len(self.keys) - sum(self.list_features)), np.int64)
        multi = []
        for j, (name, is_list) in enumerate(zip(self.keys, self.list_features)):
            col = t.column(name).combine_chunks()
            if is_list:
                lengths = col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                values = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
            else:
                values = col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            if self.num_embeddings is not None and values.size and (values.min() < 0 or values.max() >= self.num_embeddings[j]):
                raise DataError(
                    f"{where}, column {name}: ids must lie in [0, {self.num_embeddings[j]}), found "
                    f"[{values.min()}, {values.max()}] (convert again with the table size in the config)")
            if is_list:
                multi.append((lengths, values))
            else:
                onehot[:, self._column[j]] = values
        return _Rows(labels, dense, onehot, multi)

    def _own_rows(self, start_step: int) -> Iterator[_Rows]:
        """This rank's rows of the epoch stream in order, from global batch ``start_step``."""
        B, W = self.batch_size, self.world_size
        end = len(self) * B * W if self.remainder == "drop" else self.num_rows
        skip_until = start_step * B * W
        pos = 0
        handles: dict = {}
        for w, groups in enumerate(self._windows()):
            n = sum(self.row_groups[i][2] for i in groups)
            lo, hi = max(pos, skip_until), min(pos + n, end)
            if hi > lo:
                rows = self._read(groups, pos, handles)
                perm = (np.random.default_rng([self.seed, self.epoch] + ([w] if w else [])).permutation(n)
                        if self.shuffle else np.arange(n))
                positions = np.arange(lo, hi)
                mine = positions[(positions // B) % W == self.rank]
                if len(mine):
                    yield rows.take(perm[mine - pos])
            pos += n
            if pos >= end:
                break

    def _batches(self, start_step: int) -> Iterator[CTRBatch]:
        B = self.batch_size
        cur: Optional[_Rows] = None
        off, made = 0, start_step
        for rows in self._own_rows(start_step):
            # Join the previous block's tail (< B rows) once per window, then cut batches by offset.
            cur = rows if cur is None or off >= len(cur) else _Rows.concat([cur.slice(off, len(cur)), rows])
            off = 0
            while len(cur) - off >= B:
                yield self._to_batch(cur.slice(off, off + B), B)
                off += B
                made += 1
        tail = cur.slice(off, len(cur)) if cur is not None and off < len(cur) else None
        while made < len(self):
            yield self._to_batch(tail, len(tail) if tail is not None else 0)
            tail, made = None, made + 1

    def _to_batch(self, rows: Optional[_Rows], n_real: int) -> CTRBatch:
        B = self.batch_size
        if rows is None or len(rows) == 0:
            rows, n_real = self._empty_row(), 0
        if len(rows) < B:  # pad with copies of the last row, weight 0
            rows = _Rows.concat([rows, rows.take(np.full(B - len(rows), len(rows) - 1))])
        weights = np.zeros(B, dtype=np.float32)
        weights[:n_real] = 1.0
        if not rows.multi:  # all one-hot: key-major values are the transposed id matrix
            values = [rows.onehot.T.ravel()]
            lengths = [np.ones(B * len(self.keys), dtype=np.int32)]
        else:
            values, lengths = [], []
            for j, is_list in enumerate(self.list_features):
                if is_list:
                    lens, vals = rows.multi[self._column[j]]
                    values.append(vals)
                    lengths.append(lens.astype(np.int32))
                else:
                    values.append(rows.onehot[:, self._column[j]])
                    lengths.append(np.ones(B, dtype=np.int32))
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.from_numpy(np.concatenate(values)),
                                lengths=torch.from_numpy(np.concatenate(lengths)), stride=B)
        batch = CTRBatch(dense_features=torch.from_numpy(np.ascontiguousarray(rows.dense)), sparse_features=kjt,
                         labels=torch.from_numpy(rows.labels), weights=torch.from_numpy(weights))
        return batch.pin_memory() if self.pin_memory else batch

    def _empty_row(self) -> _Rows:
        multi = [(np.zeros(1, np.int64), np.zeros(0, np.int64)) for is_list in self.list_features if is_list]
        onehot = np.zeros((1, len(self.keys) - len(multi)), np.int64)
        return _Rows(np.zeros(1, np.float32), np.zeros((1, len(self.dense_names)), np.float32), onehot, multi)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[CTRBatch]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[CTRBatch]:
        """This epoch's batches from batch ``start`` on: the exact stream a resumed run needs."""
        if self.prefetch <= 0:
            return self._batches(start)
        return _prefetched(self._batches(start), self.prefetch)


def _prefetched(gen: Iterator[CTRBatch], depth: int) -> Iterator[CTRBatch]:
    """Run ``gen`` in a background thread, ``depth`` batches ahead; re-raise its errors here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in gen:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            q.put(err)

    thread = threading.Thread(target=work, daemon=True, name="recsys_dist-prefetch")
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
