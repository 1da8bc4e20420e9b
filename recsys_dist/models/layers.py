"""Building blocks shared by the model families of ``recsys_dist/models/zoo/``: MLPs and the
reads of an EmbeddingBagCollection's pooled output.

Pooled embeddings are read by feature name (the sharded EBC's output has the unsharded key
order, recsys_dist.distributed.key_order, but a name says which column is which). ``F`` =
number of sparse features, ``E`` = embedding_dim. :func:`pooled_embeddings` and
:func:`pooled_and_first_order` are torch.fx leaves: call them through this module
(``layers.pooled_embeddings(...)``), since torch.fx.wrap patches the name in this module's
namespace only, which a name imported elsewhere would miss.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedTensor


def mlp(
    in_features: int,
    sizes: list[int],
    dropout: float = 0.0,
    norm: str = "none",
    activation: str = "relu",
    device: torch.device | None = None,
    init_std: float | None = None,
) -> nn.Sequential:
    """Linear -> norm (batch / layer / none) -> activation -> dropout, per hidden size.

    ``init_std``: hidden weights start normal(0, init_std) (DeepCTR-Torch's default is 1e-4);
    None keeps PyTorch's default (Kaiming uniform)."""
    acts = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}
    layers: list[nn.Module] = []
    for size in sizes:
        layers.append(nn.Linear(in_features, size, device=device))
        if init_std is not None:
            nn.init.normal_(layers[-1].weight, 0.0, init_std)
        if norm == "batch":
            layers.append(nn.BatchNorm1d(size, device=device))
        elif norm == "layer":
            layers.append(nn.LayerNorm(size, device=device))
        layers.append(acts[activation]())
        if dropout:
            layers.append(nn.Dropout(dropout))
        in_features = size
    return nn.Sequential(*layers)


def mlp_head(in_features: int, sizes: list[int], device: torch.device | None = None, **mlp_options) -> nn.Sequential:
    """:func:`mlp` over ``sizes`` (none: no hidden layer), then a linear layer to one output:
    ``[B, in_features] -> [B, 1]``. Child 0 is the MLP, child 1 the output layer."""
    return nn.Sequential(
        mlp(in_features, sizes, device=device, **mlp_options),
        nn.Linear(sizes[-1] if sizes else in_features, 1, device=device),
    )


# Leaves for torch.fx: TrainPipelineSparseDist traces the model, and these read the
# KeyedTensor's keys and shapes, which a trace cannot see.
@torch.fx.wrap
def pooled_embeddings(kt: KeyedTensor, keys: list[str]) -> torch.Tensor:
    """[B, F, E] pooled embeddings of ``keys`` in that order, every table of width E: a view of
    the EBC's output when its columns are in that order already (the usual case), else one
    gather, a copy forward and a scatter backward every step, which the view avoids (see
    docs/design/0006-per-step-overhead-tried-and-not-kept.md)."""
    (v,) = _groups(kt, keys)
    return v.reshape(v.shape[0], len(keys), -1)


@torch.fx.wrap
def pooled_and_first_order(kt: KeyedTensor, deep: list[str], first: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, F, E] pooled embeddings of the ``deep`` keys in order, as :func:`pooled_embeddings`; [B]
    sum over the ``first`` keys of each per-id weight). A first-order weight is the mean of
    its table's 4 columns (FBGEMM needs widths that are multiples of 4); a mean, not a sum:
    the 4 columns get the same gradient, and a sum would move 4x faster than the configured
    learning rate."""
    v, w = _groups(kt, deep, first)
    return v.reshape(v.shape[0], len(deep), -1), w.sum(dim=1) * (len(first) / w.shape[1])


def _groups(kt: KeyedTensor, *groups: list[str]) -> list[torch.Tensor]:
    """Per group of keys, [B, sum of their widths]: their columns of ``kt`` in group order."""
    values = kt.values()
    return [
        _take(values, cols)
        for cols in _columns(tuple(kt.keys()), tuple(kt.length_per_key()), *(tuple(g) for g in groups))
    ]


def _take(values: torch.Tensor, cols: slice | tuple[int, ...]) -> torch.Tensor:
    if isinstance(cols, slice):
        return values[:, cols]  # a view
    return values.index_select(1, _index(cols, values.device))


@functools.lru_cache(maxsize=64)
def _index(cols: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The column indices as a tensor on ``device``, made once (no host-to-device copy per step)."""
    return torch.tensor(cols, device=device)


@functools.lru_cache(maxsize=64)
def _columns(keys: tuple[str, ...], lengths: tuple[int, ...], *groups: tuple[str, ...]) -> tuple:
    """Per group of keys, its columns in a KeyedTensor's values: a slice when they are one
    run in the group's order (the usual layout), else their column indices. Computed once
    per layout, not per step."""
    start = dict(zip(keys, itertools.accumulate((0, *lengths))))
    width = dict(zip(keys, lengths))
    out = []
    for group in groups:
        cols = tuple(c for k in group for c in range(start[k], start[k] + width[k]))
        contiguous = cols == tuple(range(cols[0], cols[0] + len(cols)))
        out.append(slice(cols[0], cols[0] + len(cols)) if contiguous else cols)
    return tuple(out)
