"""Parquet -> rank-sharded CTR batches (dense tensor, KeyedJaggedTensor, labels, weights).

Every rank yields the same number of batches per epoch, each of exactly ``batch_size``
rows, so collective calls inside the sharded model (input_dist / output_dist all-to-all)
never wait on a rank that ran out of data. Global batch ``g`` holds rows
``order[g*B*W : (g+1)*B*W]`` of the epoch's order and rank ``r`` takes the ``r``-th
slice of ``B`` rows. The remainder after the last full global batch is either dropped
or padded: padded rows repeat row 0 with ``weight == 0`` and never count in loss or
metrics.

KJT layout of a batch (one-hot Criteo, keys C1..C26, B rows)::

    values  = [C1 of row 0..B-1, C2 of row 0..B-1, ..., C26 of row 0..B-1]   int64
    lengths = [1] * 26 * B                                                    int32
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
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


class ParquetBatchLoader:
    """Batches of one Parquet split for one rank.

    Args:
        path: Parquet file with ``label`` (float32), dense float32 and sparse int64 columns.
        batch_size: rows per batch on this rank.
        rank, world_size: this rank and the number of ranks.
        dense_names, sparse_names: column names, in model order.
        shuffle: new seeded order each epoch (``seed + epoch``); identical on every rank.
        seed: base seed.
        remainder: ``"pad"`` or ``"drop"`` (see module docstring).
        num_embeddings: per sparse feature; ids at or past it raise :class:`DataError`.

    Raises:
        DataError: missing columns, wrong dtypes, ids out of range, or (with ``drop``)
            fewer rows than one global batch.
    """

    def __init__(
        self,
        path: str,
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
        pin_memory: bool = False,
    ) -> None:
        table = pq.read_table(path)
        missing = [c for c in ["label", *dense_names, *sparse_names] if c not in table.column_names]
        if missing:
            raise DataError(f"{path}: missing columns {missing}")
        self.labels = table.column("label").to_numpy().astype(np.float32)
        self.dense = np.stack([table.column(n).to_numpy().astype(np.float32) for n in dense_names], axis=1)
        bad = ~np.isfinite(self.dense)
        if bad.any():
            row, col = map(int, np.argwhere(bad)[0])
            raise DataError(f"{path}, row {row}, column {dense_names[col]}: {self.dense[row, col]} is not finite")
        # Feature-major [F, N] so one fancy-index gives KJT's key-major values directly.
        self.sparse = np.stack([table.column(n).to_numpy() for n in sparse_names], axis=0).astype(np.int64)
        if num_embeddings is not None:
            for j, n in enumerate(sparse_names):
                col = self.sparse[j]
                if col.size and (col.min() < 0 or col.max() >= num_embeddings[j]):
                    raise DataError(
                        f"{path}, column {n}: ids must lie in [0, {num_embeddings[j]}), found "
                        f"[{col.min()}, {col.max()}] (convert again with the table size in the config)"
                    )
        self.path, self.batch_size, self.rank, self.world_size = path, batch_size, rank, world_size
        self.keys = list(sparse_names)
        self.shuffle, self.seed, self.remainder = shuffle, seed, remainder
        self.pin_memory = pin_memory
        self.epoch = 0
        if remainder not in ("pad", "drop"):
            raise ValueError(f"remainder must be 'pad' or 'drop', got {remainder!r}")
        if len(self) == 0 and self.num_rows > 0:
            raise DataError(
                f"{path}: {self.num_rows} rows are fewer than one global batch "
                f"({batch_size} x {world_size} ranks) and data.remainder is 'drop'; use 'pad' or a smaller batch"
            )

    @property
    def num_rows(self) -> int:
        return len(self.labels)

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        return steps_per_epoch(self.num_rows, self.batch_size, self.world_size, self.remainder)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)

    def batch_at(self, order: np.ndarray, step: int) -> CTRBatch:
        B = self.batch_size
        start = step * B * self.world_size + self.rank * B
        idx = order[start : start + B]
        n_real = len(idx)
        if n_real < B:
            idx = np.concatenate([idx, np.zeros(B - n_real, dtype=idx.dtype)])
        weights = np.zeros(B, dtype=np.float32)
        weights[:n_real] = 1.0
        values = torch.from_numpy(self.sparse[:, idx].reshape(-1))
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=values,
            lengths=torch.ones(len(self.keys) * B, dtype=torch.int32),
            stride=B,
        )
        batch = CTRBatch(
            dense_features=torch.from_numpy(self.dense[idx]),
            sparse_features=kjt,
            labels=torch.from_numpy(self.labels[idx]),
            weights=torch.from_numpy(weights),
        )
        return batch.pin_memory() if self.pin_memory else batch

    def __iter__(self) -> Iterator[CTRBatch]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[CTRBatch]:
        """This epoch's batches from batch ``start`` on: the exact stream a resumed run needs."""
        order = self._order()
        for step in range(start, len(self)):
            yield self.batch_at(order, step)
