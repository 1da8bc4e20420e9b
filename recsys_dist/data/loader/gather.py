"""Gathering rows of a window into batch layout, a block of batches at a time (the loader's
``_cut`` then makes each batch a view of its block)."""

from __future__ import annotations

import numpy as np
import torch

from recsys_dist.data.loader.columns import Columns


def gather_block(
    cols: Columns,
    idx: np.ndarray,
    batch_size: int,
    n_onehot: int,
    ones_lengths: torch.Tensor,
    pin_memory: bool,
    n_real: int | None = None,
) -> tuple:
    """Rows ``idx`` of ``cols`` (a multiple of ``batch_size`` B of them), gathered once per
    column into batch layout: one-hot ids [nb, K1, B], so batch b's values are the contiguous
    run ``onehot[b]`` (key-major), dense [nb, B, D], labels [nb, B] (or [nb, B, T]). ``n_real``:
    only the first rows are real (a single padded batch). ``ones_lengths``: int32 ones, at least
    B of them (a one-hot feature's lengths). Returns ``(dense, labels, sparse, weights)``:
    tensors, ``sparse`` one int64 tensor [nb, K1 * B] or (all one-hot), with multi-hot features,
    a (values, lengths) pair per batch; ``weights`` float32 [nb, B] or None (all 1)."""
    B = batch_size
    nb = len(idx) // B
    # In file order on one rank the rows are a contiguous range: a slice, no gather.
    contiguous = idx[-1] - idx[0] == len(idx) - 1 and (len(idx) < 2 or bool(np.all(np.diff(idx) == 1)))
    rows = slice(int(idx[0]), int(idx[0]) + len(idx)) if contiguous else idx
    scratch: dict = {}

    def gather(col: np.ndarray) -> np.ndarray:  # [nb, B]; np.take into a reused buffer beats col[idx]
        if contiguous:
            return col[rows].reshape(nb, B)
        if col.dtype not in scratch:
            scratch[col.dtype] = np.empty(len(idx), col.dtype)
        # mode="wrap": idx is valid, and the default "raise" copies through an extra buffer
        return np.take(col, idx, out=scratch[col.dtype], mode="wrap").reshape(nb, B)

    if cols.labels.ndim == 1:
        labels = gather(cols.labels).astype(np.float32)  # a copy: the buffer is reused, Arrow's is read-only
    else:  # several tasks: [nb, B, T]
        T = cols.labels.shape[1]
        labels = (cols.labels[rows] if contiguous else np.take(cols.labels, idx, axis=0)).reshape(nb, B, T).copy()
    D = cols.dense.shape[1]
    dense = (cols.dense[rows] if contiguous else np.take(cols.dense, idx, axis=0, mode="wrap")).reshape(nb, B, D)
    onehot = np.empty((nb, n_onehot, B), np.int64)
    bags, k = {}, 0
    for j, c in enumerate(cols.ids):
        if isinstance(c, tuple):
            lengths, values = cols._bags(j, idx)
            ends = np.concatenate([[0], np.cumsum(lengths.reshape(nb, B).sum(axis=1))])
            bags[j] = (lengths.astype(np.int32).reshape(nb, B), values, ends)
        else:
            onehot[:, k, :] = gather(c)  # widens int32 ids (see stream.read_window)
            k += 1
    weights = None  # [nb, B]; None: every row weighs 1 (the shared ones)
    if cols.weights is not None:
        weights = torch.from_numpy(gather(cols.weights).astype(np.float32))
    if n_real is not None:
        if weights is None:
            weights = torch.ones(1, B, dtype=torch.float32)
        weights[:, n_real:] = 0.0
    if bags:  # multi-hot: each batch's values and lengths joined here, off the training thread
        sparse: torch.Tensor | list = _join_bags(onehot, bags, len(cols.ids), ones_lengths[:B].numpy())
    else:
        sparse = torch.from_numpy(onehot.reshape(nb, -1))
    block = [torch.from_numpy(dense), torch.from_numpy(labels), sparse, weights]
    if pin_memory:  # once per block, not per batch; a batch is a view of pinned memory
        pin = lambda t: t.pin_memory() if t is not None else None  # noqa: E731
        block = [pin(t) if not isinstance(t, list) else [(pin(v), pin(n)) for v, n in t] for t in block]
    return tuple(block)


def _join_bags(onehot: np.ndarray, bags: dict, num_features: int, ones: np.ndarray) -> list:
    """Per batch b: (values int64, lengths int32) tensors of every feature in key order, one-hot
    ones from ``onehot[b]`` (lengths ``ones``), multi-hot ones from ``bags[j]`` = (lengths
    [nb, B], values, batch ends)."""
    sparse = []
    for b in range(len(onehot)):
        vals, lens, k = [], [], 0
        for j in range(num_features):
            if j in bags:
                bl, bv, ends = bags[j]
                vals.append(bv[ends[b] : ends[b + 1]])
                lens.append(bl[b])
            else:
                vals.append(onehot[b, k])
                lens.append(ones)
                k += 1
        sparse.append((torch.from_numpy(np.concatenate(vals)), torch.from_numpy(np.concatenate(lens))))
    return sparse
