"""Sample-weight sums of global batches and the loss scales made from them (see ``CTRBatch.loss_scale``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np
import torch


def batch_sums(carry: np.ndarray, weights: np.ndarray, size: int, out: list | deque) -> np.ndarray:
    """Appends to ``out`` the float64 sum of each full run of ``size`` rows of ``carry`` then
    ``weights`` (float32, stream order); returns the rows left over (fewer than ``size``).
    The one summation of global weights, so every path that makes them gets the same bits."""
    w = np.concatenate([carry, weights])
    full = len(w) - len(w) % size
    out.extend(float(w[lo : lo + size].sum(dtype=np.float64)) for lo in range(0, full, size))
    return w[full:]


def weighted_scales(
    blocks: Iterator[tuple], totals: Iterator[float] | deque, world_size: int, pin_memory: bool
) -> Iterator[tuple]:
    """Each block with its batches' loss_scale (float32 [nb]): this rank's weight share of
    each global batch, ``weight here x world size / total`` (``totals``: the global
    batches' weight sums in order, ``ParquetBatchLoader.global_weights``, or a deque that reading
    the blocks fills, ``ParquetBatchLoader._own_windows``; 0 where the total is 0).

    With a deque, a block whose last global batch goes on into the next window (other
    ranks' rows there) waits until the next block, which comes only after that window
    is read: at most one block more in memory."""
    W = world_size
    take = totals.popleft if isinstance(totals, deque) else totals.__next__

    def scaled(block: tuple) -> tuple:
        scales = []
        for w in block[3]:  # per batch, the float32 sum the loss divides by (losses.py), so that it cancels
            total = take()
            scales.append(float(w.sum()) * W / total if total > 0 else 0.0)
        t = torch.tensor(scales, dtype=torch.float32)
        return (*block, t.pin_memory() if pin_memory else t)

    held: list[tuple] = []
    for block in blocks:
        held.append(block)
        if isinstance(totals, deque) and len(totals) < sum(len(b[3]) for b in held):
            continue
        yield from map(scaled, held)
        held.clear()
    yield from map(scaled, held)  # the stream is read to its end: every sum is there
