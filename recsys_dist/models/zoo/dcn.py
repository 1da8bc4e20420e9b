"""DCN-V2 (Wang et al., 2021, arXiv:2008.13535): a cross network beside or before a deep MLP.

The module and its equations are ``recsys_dist.models.ctr.DCNv2``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.checks import no_sequences, one_task
from recsys_dist.models.ctr import DCNv2
from recsys_dist.models.registry import register_model
from recsys_dist.models.zoo.mlp_options import DeepModelConfig


class DCNv2Config(DeepModelConfig):
    """``model.name: dcnv2``."""

    name: Literal["dcnv2"] = "dcnv2"
    dcn_num_layers: int = Field(3, gt=0, description="Cross layers.")
    dcn_structure: Literal["stacked", "parallel"] = Field(
        "parallel", description="Cross network then MLP (stacked) or side by side (parallel)."
    )
    cross_low_rank_dim: int | None = Field(None, gt=0, description="Rank of each cross layer's weight (None = full).")


@register_model("dcnv2", DCNv2Config, checks=(one_task, no_sequences))
def build_dcnv2(spec: FeatureSpec, cfg: DCNv2Config, checks=(one_task, no_sequences)) -> DCNv2:
    """``DCNv2`` over one EmbeddingBagCollection of the spec's tables."""
    ebc = EmbeddingBagCollection(tables=spec.all_tables(), device=spec.embedding_device)
    return DCNv2(
        ebc,
        spec.num_dense,
        spec.sparse_names,
        cfg.embedding_dim,
        cfg.deep_layer_sizes,
        cfg.dcn_num_layers,
        cfg.cross_low_rank_dim,
        cfg.dcn_structure,
        device=spec.device,
        **cfg.mlp_kwargs(),
    )
