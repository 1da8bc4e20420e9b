"""The linear-plus-deep family: DeepFM, Wide & Deep and xDeepFM.

Each reads a first-order table ``w_<feature>`` per feature (width 4, averaged to one weight
per id) in the same EmbeddingBagCollection as the ``t_<feature>`` embeddings, so one
input_dist and one output_dist serve both.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.spec import FIRST_ORDER_DIM, FeatureSpec
from recsys_dist.models import layers
from recsys_dist.models.checks import no_sequences, one_task
from recsys_dist.models.config import DeepFMConfig, DeepModelConfig, WideDeepConfig, XDeepFMConfig
from recsys_dist.models.registry import register_model


class _LinearPlusDeep(nn.Module):
    """Shared by DeepFM, Wide & Deep and xDeepFM: a linear part over the dense features and
    one weight per id (first-order tables), and a deep MLP over [dense, e_1..e_F].

    ``ebc`` holds, per feature ``f``, its embedding table (width E) and its first-order table
    ``w_<f>`` (width 4, see ``layers.pooled_and_first_order``): one collection, so a
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
        self.deep = layers.mlp_head(d, deep_layer_sizes, device=device, **mlp_options)

    def split(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layers.pooled_and_first_order(self.sparse_arch(kjt), self._deep_keys, self._first_keys)

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


def _ebc(spec: FeatureSpec) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=spec.all_tables(), device=spec.embedding_device)


def _args(spec: FeatureSpec, cfg: DeepModelConfig) -> tuple:
    return (_ebc(spec), spec.num_dense, spec.sparse_names, cfg.embedding_dim, cfg.deep_layer_sizes)


def with_first_order_tables(spec: FeatureSpec) -> FeatureSpec:
    """``spec`` with a first-order table ``w_<feature>`` (width ``FIRST_ORDER_DIM``) per
    ``t_<feature>`` table: same rows, pooling and initial range (the ``on_features`` hook)."""
    first = [
        EmbeddingBagConfig(
            name=f"w_{t.feature_names[0]}",
            embedding_dim=FIRST_ORDER_DIM,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names),
            pooling=t.pooling,
            weight_init_min=t.weight_init_min,
            weight_init_max=t.weight_init_max,
        )
        for t in spec.tables
    ]
    return dataclasses.replace(spec, first_order_tables=first)


@register_model("deepfm", DeepFMConfig, checks=(one_task, no_sequences), on_features=with_first_order_tables)
def build_deepfm(spec: FeatureSpec, cfg: DeepFMConfig) -> DeepFM:
    """``DeepFM`` over the spec's tables and first-order tables."""
    return DeepFM(*_args(spec, cfg), device=spec.device, **cfg.mlp_kwargs())


@register_model("wide_deep", WideDeepConfig, checks=(one_task, no_sequences), on_features=with_first_order_tables)
def build_wide_deep(spec: FeatureSpec, cfg: WideDeepConfig) -> WideDeep:
    """``WideDeep`` over the spec's tables and first-order tables."""
    return WideDeep(*_args(spec, cfg), device=spec.device, **cfg.mlp_kwargs())


@register_model("xdeepfm", XDeepFMConfig, checks=(one_task, no_sequences), on_features=with_first_order_tables)
def build_xdeepfm(spec: FeatureSpec, cfg: XDeepFMConfig) -> XDeepFM:
    """``XDeepFM`` over the spec's tables and first-order tables."""
    return XDeepFM(*_args(spec, cfg), cfg.cin_layer_sizes, device=spec.device, **cfg.mlp_kwargs())
