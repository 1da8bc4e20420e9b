"""CTR models over TorchRec EmbeddingBagCollections: DCN-V2, DeepFM, Wide & Deep.

Every model is a plain ``nn.Module`` with ``forward(dense [B, D_dense] float32, kjt) ->
logits [B, 1]``; its tables live in ``EmbeddingBagCollection`` submodules, so
DistributedModelParallel shards them like DLRM's. ``F`` = number of sparse features,
``E`` = embedding_dim; pooled embeddings are read by feature name (the sharded EBC's output
has the unsharded key order, recsys_dist.distributed.key_order, but a name says which column is which).
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
from torchrec.modules.embedding_modules import EmbeddingBagCollection, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor


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


class DCNv2(nn.Module):
    """DCN-V2 (Wang et al., 2021, "DCN V2: Improved Deep & Cross Network", arXiv:2008.13535).

    ``x0 = [dense, e_1, ..., e_F]`` of width ``d = D_dense + F*E``. Cross layer (eq. 1):
    ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``; low-rank (eq. 2) uses ``W_l = U_l V_l^T`` with
    rank ``low_rank``. ``stacked``: logit = w^T MLP(Cross(x0)); ``parallel``: logit =
    w^T [Cross(x0), MLP(x0)].
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        num_dense: int,
        features: list[str],
        embedding_dim: int,
        deep_layer_sizes: list[int],
        num_cross_layers: int,
        low_rank: int | None = None,
        structure: str = "parallel",
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__()
        self.sparse_arch, self.features, self.structure = ebc, features, structure
        d = num_dense + len(features) * embedding_dim
        self.cross = LowRankCrossNet(d, num_cross_layers, low_rank) if low_rank else CrossNet(d, num_cross_layers)
        self.deep = mlp(d, deep_layer_sizes, device=device, **mlp_options)
        head_in = deep_layer_sizes[-1] + (d if structure == "parallel" else 0)
        self.head = nn.Linear(head_in, 1, device=device)
        if device is not None:
            self.cross.to(device)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        x0 = torch.cat([dense, pooled_embeddings(self.sparse_arch(kjt), self.features).flatten(1)], dim=1)
        if self.structure == "stacked":
            return self.head(self.deep(self.cross(x0)))
        return self.head(torch.cat([self.cross(x0), self.deep(x0)], dim=1))


class _LinearPlusDeep(nn.Module):
    """Shared by DeepFM, Wide & Deep and xDeepFM: a linear part over the dense features and
    one weight per id (first-order tables), and a deep MLP over [dense, e_1..e_F].

    ``ebc`` holds, per feature ``f``, its embedding table (width E) and its first-order table
    ``w_<f>`` (width 4, see :func:`pooled_and_first_order`): one collection, so a
    sharded model runs one input_dist and one output_dist per step, not two
    (docs/design/0001-first-order-tables-in-one-collection.md).
    ``split(kjt)`` -> ([B, F, E] embeddings, [B] first-order sum); ``linear(dense, first)``
    -> [B]; ``deep_logit(dense, v)`` -> [B, 1].

    Raises:
        ValueError: a feature without exactly one ``w_<feature>`` table and one other table.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        num_dense: int,
        features: list[str],
        embedding_dim: int,
        deep_layer_sizes: list[int],
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__()
        self.sparse_arch, self.features = ebc, features
        configs = ebc.embedding_bag_configs()
        # Embedding names (the output's keys) are "<feature>@<table>" for a feature read by two tables.
        named = [
            (t.name.startswith("w_"), f, n)
            for t, ns in zip(configs, get_embedding_names_by_table(configs))
            for f, n in zip(t.feature_names, ns)
        ]
        deep = {f: n for is_first, f, n in named if not is_first}
        first = {f: n for is_first, f, n in named if is_first}
        missing = [f for f in features if f not in deep or f not in first]
        if missing or len(configs) != 2 * len(features):
            raise ValueError(
                f"{type(self).__name__} needs, per feature, one embedding table and one first-order "
                f"table w_<feature> in its EmbeddingBagCollection, {2 * len(features)} tables in all; "
                f"it has {len(configs)}, and features without both: {missing}"
            )
        self._deep_keys, self._first_keys = [deep[f] for f in features], [first[f] for f in features]
        self.dense_linear = nn.Linear(num_dense, 1, device=device)
        if mlp_options.get("init_std") is not None:
            nn.init.normal_(self.dense_linear.weight, 0.0, mlp_options["init_std"])
        d = num_dense + len(features) * embedding_dim
        self.deep = mlp_head(d, deep_layer_sizes, device=device, **mlp_options)

    def split(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pooled_and_first_order(self.sparse_arch(kjt), self._deep_keys, self._first_keys)

    def linear(self, dense: torch.Tensor, first_order: torch.Tensor) -> torch.Tensor:
        return self.dense_linear(dense).squeeze(1) + first_order

    def deep_logit(self, dense: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.deep(torch.cat([dense, v.flatten(1)], dim=1))


class DeepFM(_LinearPlusDeep):
    """DeepFM (Guo et al., 2017, IJCAI, arXiv:1703.04247), eq. 1-4.

    ``y = w0 + <w, dense> + sum_i w_i(x_i)`` (first order, tables ``w_<feature>``)
    ``+ 0.5 * sum_k [(sum_i v_ik)^2 - sum_i v_ik^2]`` (FM second order over the F field
    embeddings) ``+ MLP([dense, v_1..v_F])`` (deep part sharing the embeddings).
    """

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        v, first = self.split(kjt)  # [B, F, E], [B]
        fm = 0.5 * (v.sum(dim=1).pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)  # [B]
        return self.deep_logit(dense, v) + (self.linear(dense, first) + fm).unsqueeze(1)


class WideDeep(_LinearPlusDeep):
    """Wide & Deep (Cheng et al., 2016, DLRS, arXiv:1606.07792), eq. 3.

    ``y = w_wide^T [x, ids] + w_deep^T MLP([dense, e_1..e_F]) + b``: the wide part is a
    linear model over the dense features and one weight per categorical id (first-order tables).
    """

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        v, first = self.split(kjt)
        return self.deep_logit(dense, v) + self.linear(dense, first).unsqueeze(1)


class CIN(nn.Module):
    """Compressed Interaction Network (Lian et al., 2018, xDeepFM, arXiv:1803.05170, eq. 6-8).

    ``X^0 = [e_1..e_m]`` [B, m, E]; layer k: ``X^k_h = sum_{i,j} W^{k,h}_{ij} (X^{k-1}_i * X^0_j)``
    (a 1x1 convolution over the ``H_{k-1} * m`` outer products), then sum pooling over the
    embedding dimension; the pooled maps of every layer are concatenated: [B, sum_k H_k].
    """

    def __init__(self, num_fields: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        sizes = [num_fields, *layer_sizes]
        self.convs = nn.ModuleList(
            nn.Conv1d(sizes[k] * num_fields, sizes[k + 1], 1, device=device) for k in range(len(layer_sizes))
        )

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        b, m, e = x0.shape
        xk, pooled = x0, []
        for conv in self.convs:
            z = torch.einsum("bhe,bme->bhme", xk, x0).reshape(b, -1, e)
            xk = conv(z)
            pooled.append(xk.sum(dim=2))
        return torch.cat(pooled, dim=1)


class XDeepFM(_LinearPlusDeep):
    """xDeepFM (Lian et al., 2018, KDD, arXiv:1803.05170), eq. 9.

    ``y = w_lin^T [dense, ids] + w_cin^T CIN(e_1..e_F) + MLP([dense, e_1..e_F]) + b``: the
    linear part uses first-order tables (``w_<feature>``), CIN and the deep part share the
    embeddings.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        num_dense: int,
        features: list[str],
        embedding_dim: int,
        deep_layer_sizes: list[int],
        cin_layer_sizes: list[int],
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__(ebc, num_dense, features, embedding_dim, deep_layer_sizes, device, **mlp_options)
        self.cin = CIN(len(features), cin_layer_sizes, device=device)
        self.cin_out = nn.Linear(sum(cin_layer_sizes), 1, device=device)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        v, first = self.split(kjt)
        return self.deep_logit(dense, v) + self.cin_out(self.cin(v)) + self.linear(dense, first).unsqueeze(1)
