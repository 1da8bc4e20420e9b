"""Converted rows as model batches: :class:`CTRBatch` (dense tensor, KeyedJaggedTensor, labels,
weights) and :class:`BatchLayout`, the one way converted columns become batches. The loader uses
it on each window of a Parquet split, ``recsys_dist.data.encode.Encoder`` on rows converted in
memory (``POST /score``), so both give a row the same tensors.

KJT layout of a batch (keys C1..C26, B rows; multi-hot list columns give variable lengths)::

    values  = [C1 ids of rows 0..B-1, C2 ids of rows 0..B-1, ..., C26 ids of rows 0..B-1]  int64
    lengths = [ids per row for C1] + [... for C2] + ...                                     int32
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.loader.columns import Columns
from recsys_dist.data.loader.gather import gather_block
from recsys_dist.data.loader.stream import table_columns


@dataclass
class CTRBatch(Batch):
    """TorchRec ``Batch`` plus per-example weights.

    Attributes:
        dense_features: float32 [B, num_dense].
        sparse_features: KJT with int64 values, keys = the categorical feature names.
        labels: float32 [B] in {0, 1}; [B, T] with several tasks (``data.schema.labels``, in
            task order; a regression task's column holds its target value).
        weights: float32 [B]; the row's sample weight (1 without ``data.schema.weight``) for
            real rows, 0 for padding.
        loss_scale: float32 scalar, ``weight here x world size / weight of the global batch``
            (weight: the sum of ``weights``, i.e. the real rows without ``data.schema.weight``;
            1 for a batch without padding and without sample weights), or None (then 1). The
            training loss, a weighted mean over this rank's rows, is multiplied by it, so that
            after DDP's averaging over ranks the step's loss and gradients are the weighted
            mean over the rows of the whole global batch (``recsys_dist.models.task.CTRTask``).
    """

    weights: torch.Tensor = None  # type: ignore[assignment]
    loss_scale: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> CTRBatch:
        return CTRBatch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            weights=self.weights.to(device=device, non_blocking=non_blocking),
            loss_scale=None
            if self.loss_scale is None
            else self.loss_scale.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        self.weights.record_stream(stream)
        if self.loss_scale is not None:
            self.loss_scale.record_stream(stream)

    def pin_memory(self) -> CTRBatch:
        return CTRBatch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
            weights=self.weights.pin_memory(),
            loss_scale=None if self.loss_scale is None else self.loss_scale.pin_memory(),
        )


def _row(row: int) -> str:
    return f"row {row}"


class BatchLayout:
    """How converted columns become batches of ``batch_size`` rows: :meth:`columns` (a converted
    table as checked numpy columns), :meth:`gather` (rows into batch layout, a block of batches at
    once) and :meth:`cut` (a block's batches, as views of it); :meth:`batches` all three for every
    row in order.

    Args:
        dense_names, keys: the dense columns and the sparse features (the KJT's keys), in model order.
        label_columns: the label column(s) (one per task).
        batch_size: rows per batch.
        weight_column: the sample-weight column, or None (every row weighs 1).
        id_bounds: per feature the table's rows (ids must lie in ``[0, bound)``), or None (unchecked).
        pin_memory: gathered blocks (and the shared ones) in pinned memory.
    """

    def __init__(
        self,
        dense_names: list[str],
        keys: list[str],
        label_columns: list[str],
        batch_size: int,
        weight_column: str | None = None,
        id_bounds: list[int] | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.dense_names, self.keys, self.label_columns = list(dense_names), list(keys), list(label_columns)
        self.batch_size, self.weight_column, self.id_bounds = batch_size, weight_column, id_bounds
        self.pin_memory = pin_memory
        # Full batches share these (read-only): every one-hot bag has length 1, every row weight 1.
        self.ones_lengths = torch.ones(batch_size * len(self.keys), dtype=torch.int32)
        self.ones_weights = torch.ones(batch_size, dtype=torch.float32)
        if pin_memory:
            self.ones_lengths, self.ones_weights = self.ones_lengths.pin_memory(), self.ones_weights.pin_memory()

    def columns(self, table: pa.Table, where: Callable[[int], str] = _row) -> Columns:
        """The converted ``table``'s rows as checked numpy columns (``loader.stream.table_columns``);
        ``where(row)`` names a row in an error (default ``row N``, 0-based).

        Raises:
            DataError: a null or out-of-range id, a non-finite label or dense value, a bad weight.
        """
        return table_columns(
            table, self.label_columns, self.dense_names, self.keys, self.id_bounds, self.weight_column, where
        )

    def gather(self, cols: Columns, idx: np.ndarray, n_real: int | None = None, rows: int | None = None) -> tuple:
        """Rows ``idx`` of ``cols`` (a multiple of the batch's rows) in batch layout
        (:func:`gather.gather_block`); ``rows``: a batch's rows when not ``batch_size`` (fewer)."""
        B = rows or self.batch_size
        n_onehot = sum(not isinstance(c, tuple) for c in cols.ids)
        return gather_block(cols, idx, B, n_onehot, self.ones_lengths, self.pin_memory, n_real)

    def cut(self, block: tuple, rows: int | None = None) -> Iterator[CTRBatch]:
        """The batches of a gathered block (:meth:`gather`, the first four entries), as views of
        it; ``rows``: as in :meth:`gather`."""
        B = rows or self.batch_size
        ones_lengths, ones_weights = self.ones_lengths, self.ones_weights
        if B != self.batch_size:
            ones_lengths, ones_weights = ones_lengths[: B * len(self.keys)], ones_weights[:B]
        dense, labels, sparse, weights = block
        multi = isinstance(sparse, list)
        for b in range(len(dense)):
            values, lengths = sparse[b] if multi else (sparse[b], ones_lengths)
            yield CTRBatch(
                dense_features=dense[b],
                sparse_features=KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths, stride=B),
                labels=labels[b],
                weights=ones_weights if weights is None else weights[b],
            )

    def batches(self, cols: Columns) -> Iterator[CTRBatch]:
        """Every row of ``cols`` in order, in batches of ``batch_size`` rows, the last one of
        exactly the rows left (no padding); gathered a batch at a time."""
        n, B = len(cols), self.batch_size
        for lo in range(0, n, B):
            rows = min(B, n - lo)
            yield from self.cut(self.gather(cols, np.arange(lo, lo + rows), rows=rows), rows=rows)
