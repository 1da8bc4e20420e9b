"""The linear-plus-deep family: DeepFM, Wide & Deep and xDeepFM.

Each reads a first-order table ``w_<feature>`` per feature (width 4, averaged to one weight
per id) in the same EmbeddingBagCollection as the ``t_<feature>`` embeddings, so one
input_dist and one output_dist serve both. Modules and equations: ``recsys_dist.models.ctr``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field, model_validator
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_dist.data.spec import FIRST_ORDER_DIM, FeatureSpec
from recsys_dist.models.checks import no_sequences, one_task
from recsys_dist.models.ctr import DeepFM, WideDeep, XDeepFM
from recsys_dist.models.registry import register_model
from recsys_dist.models.zoo.mlp_options import DeepModelConfig


class DeepFMConfig(DeepModelConfig):
    """``model.name: deepfm`` (Guo et al., 2017)."""

    name: Literal["deepfm"] = "deepfm"


class WideDeepConfig(DeepModelConfig):
    """``model.name: wide_deep`` (Cheng et al., 2016)."""

    name: Literal["wide_deep"] = "wide_deep"


class XDeepFMConfig(DeepModelConfig):
    """``model.name: xdeepfm`` (Lian et al., 2018)."""

    name: Literal["xdeepfm"] = "xdeepfm"
    cin_layer_sizes: list[int] = Field([64, 64], description="Feature maps per CIN layer.")

    @model_validator(mode="after")
    def _check_cin(self):
        if not self.cin_layer_sizes or any(s <= 0 for s in self.cin_layer_sizes):
            raise ValueError(
                f"model.cin_layer_sizes must be a non-empty list of positive ints, got {self.cin_layer_sizes}"
            )
        return self


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
