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
memory is about two windows (as read, and gathered into batch layout) plus the prefetched
batches, whatever the file sizes. When a split fits in one window the order is a plain
seeded permutation of all its rows.

Row groups per rank (``rank_reads="row_groups"``). Each rank's stream is only its own share
of the row groups (``partition_row_groups``: balanced by rows, fixed for a world size),
windowed and shuffled as above with seeds that include the rank, and the rank takes every
row of it. Reads per rank drop by about the world size, but global batches then depend on
the world size. Steps per epoch: the largest share's ``ceil(rows / B)`` under ``pad`` (ranks
with fewer rows pad), the smallest share's ``rows // B`` under ``drop``.

Remainder. Rows after the last full global batch are either dropped (``drop``) or padded
(``pad``): padded rows repeat the rank's last row with ``weight == 0`` and never count in
loss or metrics; a rank whose slice is empty gets a batch of padding only.

Speed. Each window is gathered into batch layout in blocks of up to ``BLOCK_BATCHES``
batches (one ``np.take`` per column, one-hot ids as int32 when they fit, which halves the cost
of the random reads); a batch is then views of its block: its one-hot values are one
contiguous run, its lengths a shared tensor of ones. Outputs are identical to the per-batch
gather this replaced. With ``prefetch`` on, reading and gathering run in background threads
and hand over whole blocks, so the training thread only cuts views (tens of microseconds a
batch) and no thread wakes up per step: at small batches on ranks that share cores, a
per-batch hand-over cost more than the batch itself. Windows decode into pyarrow's system
pool (:mod:`recsys_dist.data.parquet_io` says why).

Modules: ``options`` (:class:`LoaderOptions`, how a loader reads), ``stream`` (a window of row
groups read and checked), ``columns`` (its rows as numpy columns), ``gather`` (rows into batch
layout), ``batch`` (:class:`CTRBatch`, and :class:`BatchLayout`: converted columns into batches,
shared with ``recsys_dist.data.encode``; the KJT layout of a batch), ``weights`` (sample-weight
sums, loss scales).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Unpack

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys_dist.data.loader.batch import BatchLayout, CTRBatch
from recsys_dist.data.loader.columns import Columns
from recsys_dist.data.loader.options import LoaderKeywords, LoaderOptions
from recsys_dist.data.loader.stream import check_types, is_list_type, read_window
from recsys_dist.data.loader.weights import batch_sums, weighted_scales
from recsys_dist.data.prefetch import prefetched
from recsys_dist.errors import DataError

BLOCK_BATCHES = 64  # batches gathered at once and handed over together (memory: blocks, not windows)


def steps_per_epoch(num_rows: int, batch_size: int, world_size: int, remainder: str) -> int:
    """Global batches per epoch: rows / (batch_size x world_size), rounded up for "pad"."""
    per_step = batch_size * world_size
    return num_rows // per_step if remainder == "drop" else -(-num_rows // per_step)


def partition_row_groups(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Row-group indices per rank, balanced by rows: largest groups first, each to the rank
    with the fewest rows so far (ties: the lowest rank); each rank's list in file order.
    Depends only on the sizes and the world size, so it is the same in every epoch."""
    owned: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep file order
        r = min(range(world_size), key=lambda r: load[r])
        owned[r].append(i)
        load[r] += sizes[i]
    return [sorted(o) for o in owned]


class ParquetBatchLoader:
    """Batches of one Parquet split (one or several files) for one rank.

    Args:
        path: Parquet file or files with the label column(s) (float), dense float and sparse int64
            (one-hot) or list<int64> (multi-hot) columns; all files must share one schema.
        batch_size: rows per batch on this rank.
        rank, world_size: this rank and the number of ranks.
        dense_names, sparse_names: column names, in model order.
        options: how it reads (:class:`LoaderOptions`: shuffle, seed, remainder, id bounds, prefetch,
            label and weight columns, ...); default ``LoaderOptions()``.
        **changes: :class:`LoaderOptions` fields given by name, applied over ``options``
            (``ParquetBatchLoader(path, 64, 0, 1, dense, sparse, shuffle=True, seed=1)``).

    Raises:
        DataError: a missing file or column, files with different schemas, no rows with
            ``drop``; while iterating, an id out of range or null, a non-finite label or dense value,
            naming the file, row (0-based, in that file) and column.
        ValueError: an unknown ``remainder`` or ``rank_reads``.
        TypeError: a keyword that is not a :class:`LoaderOptions` field.
    """

    def __init__(
        self,
        path: str | Sequence[str],
        batch_size: int,
        rank: int,
        world_size: int,
        dense_names: list[str],
        sparse_names: list[str],
        options: LoaderOptions | None = None,
        **changes: Unpack[LoaderKeywords],
    ) -> None:
        options = (options or LoaderOptions()).changed(**changes)
        self.files = (
            [str(path)] if isinstance(path, (str, bytes)) or hasattr(path, "__fspath__") else [str(p) for p in path]
        )
        self.dense_names, self.keys = list(dense_names), list(sparse_names)
        self.label_columns, self.weight_column = list(options.label_columns), options.weight_column
        weights = [options.weight_column] if options.weight_column else []
        self.columns = [*self.label_columns, *dense_names, *sparse_names, *weights]
        schema = self._open_files()
        self.list_features = [schema is not None and is_list_type(schema.field(n).type) for n in sparse_names]
        self.num_rows = sum(n for *_, n in self.row_groups)
        self.path, self.batch_size, self.rank, self.world_size = self.files[0], batch_size, rank, world_size
        self.shuffle, self.seed, self.remainder = options.shuffle, options.seed, options.remainder
        self.num_embeddings, self.buffer_rows = options.num_embeddings, options.shuffle_buffer_rows
        self.prefetch, self.pin_memory, self.rank_reads = options.prefetch, options.pin_memory, options.rank_reads
        self.scale_losses = options.scale_losses
        self.epoch = 0
        self._plan_stream()
        # converted columns -> batches, as recsys_dist.data.encode makes them from rows in memory
        self.layout = BatchLayout(
            self.dense_names,
            self.keys,
            self.label_columns,
            batch_size,
            self.weight_column,
            self.num_embeddings,
            self.pin_memory,
        )

    def _open_files(self) -> pa.Schema | None:
        """Check every file's columns and their types (one schema for all), and list the row
        groups as ``self.row_groups``: (file index, row group, rows). Returns the columns' schema."""
        self.row_groups: list[tuple[int, int, int]] = []
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
            check_types(f, picked, set(self.keys))
            if schema is not None and not picked.equals(schema):
                raise DataError(f"{f}: schema differs from {self.files[0]}: {picked} vs {schema}")
            schema = picked
            self.row_groups += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        return schema

    def _plan_stream(self) -> None:
        """The stream this rank reads (row-group indices, and (ranks, rank) sharing each batch of
        it), the batches per epoch, and the leading batches in which no rank pads."""
        batch_size, world_size, rank, remainder = self.batch_size, self.world_size, self.rank, self.remainder
        sizes = [n for *_, n in self.row_groups]
        if self.rank_reads == "row_groups":
            owned = partition_row_groups(sizes, world_size)
            rows = [sum(sizes[i] for i in o) for o in owned]
            self._groups, self._split = owned[rank], (1, 0)
            self._share_rows = rows
            self._len = min(rows) // batch_size if remainder == "drop" else max(-(-n // batch_size) for n in rows)
        else:
            self._groups, self._split = list(range(len(self.row_groups))), (world_size, rank)
            self._share_rows = []
            self._len = steps_per_epoch(self.num_rows, batch_size, world_size, remainder)
        # Leading batches of an epoch in which no rank holds padding (their loss_scale is 1).
        if self.rank_reads == "row_groups":
            self._unpadded_steps = min(min(rows) // batch_size, self._len) if rows else 0
        else:
            self._unpadded_steps = min(self.num_rows // (batch_size * world_size), self._len)
        if self._len == 0 and self.num_rows > 0:
            what = (
                f"the fewest rows a rank owns ({min(rows)}, data.rank_reads: row_groups) are fewer than one "
                f"batch ({batch_size})"
                if self.rank_reads == "row_groups"
                else f"{self.num_rows} rows are fewer than one global batch ({batch_size} x {world_size} ranks)"
            )
            raise DataError(f"{self.path}: {what} and data.remainder is 'drop'; use 'pad' or a smaller batch")

    @property
    def options(self) -> LoaderOptions:
        """This loader's :class:`LoaderOptions` (with any attribute changed since it opened)."""
        return LoaderOptions(
            shuffle=self.shuffle,
            seed=self.seed,
            remainder=self.remainder,
            num_embeddings=self.num_embeddings,
            shuffle_buffer_rows=self.buffer_rows,
            prefetch=self.prefetch,
            pin_memory=self.pin_memory,
            rank_reads=self.rank_reads,
            label_columns=self.label_columns,
            weight_column=self.weight_column,
            scale_losses=self.scale_losses,
        )

    def reopen(self, **changes) -> ParquetBatchLoader:
        """A new loader of the same files, batch size, rank and columns, with ``changes`` to
        its :class:`LoaderOptions` (e.g. ``shuffle=False``, ``weight_column=None``) or its
        ``batch_size``.

        Raises:
            TypeError: a keyword that is neither ``batch_size`` nor an option.
        """
        batch_size = changes.pop("batch_size", self.batch_size)
        options = self.options.changed(**changes)
        return type(self)(self.files, batch_size, self.rank, self.world_size, self.dense_names, self.keys, options)

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        return self._len

    def real_rows(self, step: int, rank: int | None = None) -> int:
        """Real (unpadded) rows of batch ``step`` of an epoch on ``rank`` (default: this rank),
        or summed over every rank when ``rank`` is -1. Computed from the row counts alone (the
        stream's layout is fixed), so no rank needs to ask another."""
        B = self.batch_size
        if rank == -1:
            return sum(self.real_rows(step, r) for r in range(self.world_size))
        rank = self.rank if rank is None else rank
        if self.rank_reads == "row_groups":
            stream = self._share_rows[rank]
            end = min(self._len * B, stream) if self.remainder == "drop" else stream
            return max(0, min(B, end - step * B))
        W = self.world_size
        end = min(self._len * B * W, self.num_rows) if self.remainder == "drop" else self.num_rows
        return max(0, min(B, end - step * B * W - rank * B))

    def loss_scale(self, step: int) -> float:
        """``real_rows(step) x world_size / real_rows(step, -1)``: the factor that turns this rank's
        mean loss over its real rows into its share of the global batch's mean (see ``CTRBatch``);
        exactly 1.0 for a batch without padding on any rank."""
        total = self.real_rows(step, -1)
        return self.real_rows(step) * self.world_size / total if total else 0.0

    def global_weights(self, start: int = 0) -> Iterator[float]:
        """The sample-weight sum of each global batch of this epoch (every rank's rows of
        batch ``step``, padding 0), from batch ``start`` to the epoch's end; float64 sums in
        stream order, so the same at any world size where the global batches are.

        No rank asks another: the rows of every rank's block of a batch are fixed by the seeds
        and the row counts, so this loader reads the weight column alone of the other ranks'
        rows too (``global_batch``: the stream once as one rank with batch ``B x W``;
        ``row_groups``: each rank's share). That is one float32 column, about 4 bytes a row,
        read once more per epoch; an all_reduce of the sum per step would instead put a
        blocking collective in every step. Iterating a ``global_batch`` loader does not call
        this: its own pass reads every row of each window anyway, and sums the weights of the
        whole global batches there (:meth:`_own_windows`), to the same bits.

        Raises:
            ValueError: the loader has no ``weight_column``.
        """
        if not self.weight_column:
            raise ValueError("global_weights: the loader has no weight_column")
        W = self.world_size
        if self.rank_reads == "global_batch":
            views = [(self.batch_size * W, 0, 1)]
        else:
            views = [(self.batch_size, r, W) for r in range(W)]
        streams = []
        for batch_size, rank, world_size in views:
            view = type(self)(
                self.files,
                batch_size,
                rank,
                world_size,
                [],
                [],
                shuffle=self.shuffle,
                seed=self.seed,
                remainder=self.remainder,
                shuffle_buffer_rows=self.buffer_rows,
                prefetch=0,
                rank_reads=self.rank_reads,
                label_columns=[],
                weight_column=self.weight_column,
            )
            view.epoch = self.epoch
            streams.append(view._weight_sums(start))
        # The views are made (and the epoch read) now, not at the first batch.
        return (sum(next(s) for s in streams) for _ in range(start, len(self)))

    def _weight_sums(self, start: int) -> Iterator[float]:
        """Per batch of this loader's own rows from ``start`` on: the sum of their weights
        (float64), 0 for batches past the data."""
        carry, made, sums = np.zeros(0, np.float32), start, []
        for cols, idx in self._own_windows(start):
            carry = batch_sums(carry, cols.weights[idx], self.batch_size, sums)
            made += len(sums)
            yield from sums
            sums.clear()
        while made < len(self):
            yield float(carry.sum(dtype=np.float64))
            carry, made = carry[:0], made + 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # ------------------------------------------------------------------ reading

    def _seed(self, window: int | None = None) -> list[int]:
        """Seed of window ``window``'s permutation, or (None) of the row groups' order."""
        if self.rank_reads == "global_batch":  # the original seeds: orders stay as they were
            if window is None:
                return [self.seed, self.epoch, 1]
            return [self.seed, self.epoch] + ([window] if window else [])
        # row_groups: each rank permutes its own stream, so the rank is part of every seed.
        return [self.seed, self.epoch, 2, self.rank] + ([1] if window is None else [0, window])

    def _windows(self) -> list[list[int]]:
        """Row-group indices per window, in this epoch's order."""

        def cut(order: list[int]) -> list[list[int]]:
            windows, cur, rows = [], [], 0
            for i in order:
                cur.append(i)
                rows += self.row_groups[i][2]
                if rows >= self.buffer_rows:
                    windows.append(cur)
                    cur, rows = [], 0
            return windows + ([cur] if cur else [])

        windows = cut(self._groups)
        if self.shuffle and len(windows) > 1:
            # Several windows: the row groups' order changes each epoch too.
            perm = np.random.default_rng(self._seed()).permutation(len(self._groups))
            windows = cut([self._groups[i] for i in perm.tolist()])
        return windows

    def _read(self, groups: list[int], handles: dict) -> Columns:
        """The window of row groups ``groups`` as checked numpy columns (:func:`stream.read_window`)."""
        return read_window(self, groups, handles)

    def _own_windows(self, start_step: int, sums: deque | None = None) -> Iterator[tuple[Columns, np.ndarray]]:
        """Per window: its columns and this rank's rows of it in stream order (indices into
        the window), from batch ``start_step`` on.

        ``sums`` (``global_batch`` with a weight column): appended, as each window is read, the
        weight sums of the global batches it completes, and at the end those of the batches
        past the data; :meth:`global_weights` without a second read: the window holds every
        rank's rows, and the same summation gives the same bits."""
        B, (W, r) = self.batch_size, self._split
        stream_rows = sum(self.row_groups[i][2] for i in self._groups)
        end = min(len(self) * B * W, stream_rows) if self.remainder == "drop" else stream_rows
        skip_until = start_step * B * W
        pos = 0
        handles: dict = {}
        carry, made = np.zeros(0, np.float32), start_step  # weights of a global batch split by windows
        for w, groups in enumerate(self._windows()):
            n = sum(self.row_groups[i][2] for i in groups)
            lo, hi = max(pos, skip_until), min(pos + n, end)
            if hi > lo:
                cols = self._read(groups, handles)
                positions = np.arange(lo, hi)
                mine = positions[(positions // B) % W == r] if W > 1 else positions
                perm = np.random.default_rng(self._seed(w)).permutation(n) if self.shuffle else None
                idx = mine - pos if perm is None else perm[mine - pos]
                if sums is not None:
                    every = positions - pos if perm is None else perm[positions - pos]
                    before = len(sums)
                    carry = batch_sums(carry, cols.weights[every], B * W, sums)
                    made += len(sums) - before
                if len(idx):
                    yield cols, idx
            pos += n
            if pos >= end:
                break
        while sums is not None and made < len(self):  # the last, partial global batch; then none
            sums.append(float(carry.sum(dtype=np.float64)))
            carry, made = carry[:0], made + 1

    def _blocks(self, start_step: int, sums: deque | None = None) -> Iterator[tuple]:
        """This epoch's batches from ``start_step`` on, gathered in blocks (see :meth:`_gather`);
        ``sums``: see :meth:`_own_windows`."""
        B = self.batch_size
        carry: Columns | None = None  # rows (< B) of a batch that continues in the next window
        made = start_step
        windows = self._own_windows(start_step, sums)
        if self.prefetch > 0:  # read the next window (pyarrow, GIL released) while this one is cut
            windows = prefetched(windows, 1, "recsys_dist-windows")
        for cols, idx in windows:
            if carry is not None:
                head, idx = idx[: B - len(carry)], idx[B - len(carry) :]
                carry = Columns.concat([carry, cols.take(head)])
                if len(carry) < B:
                    continue
                yield self._gather(carry, np.arange(B))
                carry, made = None, made + 1
            full = len(idx) - len(idx) % B
            for lo in range(0, full, BLOCK_BATCHES * B):
                yield self._gather(cols, idx[lo : min(full, lo + BLOCK_BATCHES * B)])
            made += full // B
            if full < len(idx):
                carry = cols.take(idx[full:])
        while made < len(self):  # pad: copies of the last real row, weight 0; then padding only
            rows, n_real = (carry, len(carry)) if carry is not None else (self._empty_row(), 0)
            pad = np.concatenate([np.arange(len(rows)), np.full(B - len(rows), len(rows) - 1)])
            yield self._gather(rows, pad, n_real)
            carry, made = None, made + 1

    def _gather(self, cols: Columns, idx: np.ndarray, n_real: int | None = None) -> tuple:
        """Rows ``idx`` of ``cols`` in batch layout: the block :meth:`_cut` makes batches of
        (:meth:`BatchLayout.gather`)."""
        return self.layout.gather(cols, idx, n_real)

    def _cut(self, block: tuple) -> Iterator[CTRBatch]:
        """The batches of a gathered block, as views of it: the training thread's only per-batch
        work (:meth:`BatchLayout.cut`)."""
        return self.layout.cut(block)

    def _empty_row(self) -> Columns:
        ids = [
            (np.zeros(1, np.int64), np.zeros(0, np.int64)) if m else np.zeros(1, np.int64) for m in self.list_features
        ]
        T = len(self.label_columns)
        labels = np.zeros(1, np.float32) if T == 1 else np.zeros((1, T), np.float32)
        weights = np.zeros(1, np.float32) if self.weight_column else None
        return Columns(labels, np.zeros((1, len(self.dense_names)), np.float32), ids, weights)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[CTRBatch]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[CTRBatch]:
        """This epoch's batches from batch ``start`` on: the exact stream a resumed run needs.
        With ``prefetch`` the background threads start now, so opening the iterator early
        overlaps its first read with other work."""
        if self.scale_losses and self.weight_column and self.world_size > 1:
            # The scales are worked out with the blocks: in the prefetch thread, not the
            # training thread. Under global_batch this rank's own reads hold every row of the
            # global batches, so their weight sums come from them; under row_groups the other
            # ranks' weights are read (global_weights).
            if self.rank_reads == "global_batch":
                sums: deque = deque()
                blocks = self._weighted_scales(self._blocks(start, sums), sums)
            else:
                blocks = self._weighted_scales(self._blocks(start), self.global_weights(start))
        else:
            blocks = self._blocks(start)
        if self.prefetch > 0:
            # Whole blocks cross threads: a batch-by-batch hand-over woke a thread every step.
            blocks = prefetched(blocks, -(-self.prefetch // BLOCK_BATCHES), "recsys_dist-blocks")
        return self._cut_all(blocks, start)

    def _weighted_scales(self, blocks: Iterator[tuple], totals: Iterator[float] | deque) -> Iterator[tuple]:
        """Each block with its batches' loss_scale (:func:`weights.weighted_scales`)."""
        return weighted_scales(blocks, totals, self.world_size, self.pin_memory)

    def _row_scale(self, step: int, one: torch.Tensor) -> torch.Tensor:
        """Batch ``step``'s loss_scale from row counts (no sample weights): the shared ``one``
        while no rank pads, else :meth:`loss_scale` as a float32 scalar."""
        scale = self.loss_scale(step) if step >= self._unpadded_steps else 1.0
        if scale == 1.0:
            return one
        t = torch.tensor(scale, dtype=torch.float32)
        return t.pin_memory() if self.pin_memory else t

    def _cut_all(self, blocks: Iterator[tuple], start: int) -> Iterator[CTRBatch]:
        # Every batch carries its loss_scale (unless ``scale_losses`` is off): one shared tensor
        # while no rank pads, then per batch; with sample weights on several ranks, the block's
        # fifth entry (:meth:`_weighted_scales`).
        one = torch.ones((), dtype=torch.float32)
        if self.pin_memory:
            one = one.pin_memory()
        step = start
        try:
            for block in blocks:
                scales = block[4] if len(block) > 4 else None
                for b, batch in enumerate(self._cut(block[:4])):
                    if self.scale_losses:  # else None: an evaluation loader
                        batch.loss_scale = scales[b] if scales is not None else self._row_scale(step, one)
                    step += 1
                    yield batch
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:  # stops the producer thread when the consumer stops early
                close()
