"""Refusing ids outside their table: the forward pre-hook ``shard(check_ids=True)`` registers."""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def id_limits(tables: list[BaseEmbeddingConfig]) -> dict[str, tuple[int, str]]:
    """Feature name -> (rows of the smallest table it feeds, that table's name)."""
    out: dict[str, tuple[int, str]] = {}
    for t in tables:
        for f in t.feature_names:
            if f not in out or t.num_embeddings < out[f][0]:
                out[f] = (t.num_embeddings, t.name)
    return out


def check_kjt_ids(kjt: KeyedJaggedTensor, limits: dict[str, tuple[int, str]]) -> None:
    """Refuse a KeyedJaggedTensor holding an id outside ``[0, num_embeddings)`` of its table.

    One comparison over all values against each value's feature's limit, and one host sync.
    Features of no table are not checked.

    Raises:
        ValueError: names the feature, the first bad id, the table and its size.
    """
    keys = kjt.keys()
    if not keys or not any(k in limits for k in keys):
        return
    lengths = kjt.length_per_key()
    total = sum(lengths)
    values = kjt.values()[:total]
    if total == 0:
        return
    dev = values.device
    repeats = torch.tensor(lengths, device=dev)
    big = torch.iinfo(torch.int64).max
    per_key = torch.tensor([limits[k][0] if k in limits else big for k in keys], device=dev)
    bad = (values < 0) | (values >= torch.repeat_interleave(per_key, repeats, output_size=total))
    if not all(k in limits for k in keys):  # features of no table: not checked
        bad &= torch.repeat_interleave(
            torch.tensor([k in limits for k in keys], device=dev), repeats, output_size=total
        )
    if not bool(bad.any()):
        return
    i = int(torch.nonzero(bad)[0])
    k, start = 0, 0
    while start + lengths[k] <= i:
        start += lengths[k]
        k += 1
    rows, table = limits[keys[k]]
    raise ValueError(
        f"feature {keys[k]!r}: id {int(values[i])} is out of range for table {table!r} of {rows} rows "
        f"(ids must lie in [0, {rows - 1}]); {int(bad.sum())} id(s) of this batch are out of range"
    )


def _kjts(args: tuple, kwargs: dict) -> list[KeyedJaggedTensor]:
    """The KeyedJaggedTensors among a call's arguments: the arguments themselves, and the
    ``sparse_features`` attribute of a batch object."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, KeyedJaggedTensor):
            found.append(a)
        elif isinstance(getattr(a, "sparse_features", None), KeyedJaggedTensor):
            found.append(a.sparse_features)
    return found


def ids_check_hook(tables: list[BaseEmbeddingConfig]):
    """A forward pre-hook (``with_kwargs=True``) running :func:`check_kjt_ids` on every KJT
    passed to the module, directly or as a batch's ``sparse_features``."""
    limits = id_limits(tables)

    def hook(module, args, kwargs):
        for kjt in _kjts(args, kwargs):
            check_kjt_ids(kjt, limits)

    return hook
