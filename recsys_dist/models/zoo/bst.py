"""BST (Chen et al., 2019, arXiv:1905.06874): a transformer over the user's history plus the target.

The module and its equations are ``recsys_dist.models.sequence.BST``. Pooled tables in one
EmbeddingBagCollection, sequence tables in one EmbeddingCollection: both sharded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.registry import register_model
from recsys_dist.models.sequence import BST
from recsys_dist.models.zoo.mlp_options import TargetSequenceConfig


class BSTConfig(TargetSequenceConfig):
    """``model.name: bst``."""

    name: Literal["bst"] = "bst"
    num_heads: int = Field(2, gt=0, description="Attention heads of each transformer layer; must divide embedding_dim.")
    ffn_size: int = Field(64, gt=0, description="Hidden size of each transformer layer's feed-forward network.")
    num_blocks: int = Field(1, gt=0, description="Transformer encoder layers, stacked (the paper's best is 1).")
    transformer_dropout: float = Field(
        0.1, ge=0, lt=1, description="Dropout on the attention weights and on each sublayer's output."
    )
    max_positions: int = Field(
        64,
        ge=2,
        description="Rows of the learned positional embedding: the target is position 0, the history's events "
        "1 (most recent) onwards; older events than max_positions - 1 share the last row.",
    )

    @model_validator(mode="after")
    def _check_heads(self):
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"model.num_heads: {self.num_heads} does not divide model.embedding_dim {self.embedding_dim}"
            )
        return self


@register_model("bst", BSTConfig)
def build_bst(spec: FeatureSpec, cfg: BSTConfig) -> BST:
    """``BST`` over the spec's pooled tables and its sequence tables; the positional embeddings
    start uniform in ``[-embedding_init_scale, embedding_init_scale]`` (0.05 when None).

    Raises:
        ValueError: no sequence feature, or ``target_feature`` is not a categorical feature.
    """
    return BST.from_spec(
        spec,
        cfg,
        num_heads=cfg.num_heads,
        ffn_size=cfg.ffn_size,
        num_blocks=cfg.num_blocks,
        transformer_dropout=cfg.transformer_dropout,
        max_positions=cfg.max_positions,
        position_init_scale=cfg.embedding_init_scale or 0.05,
    )
