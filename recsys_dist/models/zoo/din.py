"""DIN (Zhou et al., 2018, arXiv:1706.06978): target attention over the user's history.

The module and its equations are ``recsys_dist.models.sequence.DIN``. Pooled tables in one
EmbeddingBagCollection, sequence tables in one EmbeddingCollection: both sharded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.registry import register_model
from recsys_dist.models.sequence import DIN
from recsys_dist.models.zoo.mlp_options import TargetSequenceConfig, check_sizes


class DINConfig(TargetSequenceConfig):
    """``model.name: din``."""

    name: Literal["din"] = "din"
    attention_sizes: list[int] = Field([64, 16], description="Hidden sizes of the attention unit's MLP.")

    @model_validator(mode="after")
    def _check_attention(self):
        check_sizes("attention_sizes", self.attention_sizes)
        return self


@register_model("din", DINConfig)
def build_din(spec: FeatureSpec, cfg: DINConfig) -> DIN:
    """``DIN`` over the spec's pooled tables and its sequence tables.

    Raises:
        ValueError: no sequence feature, or ``target_feature`` is not a categorical feature.
    """
    return DIN.from_spec(spec, cfg, cfg.attention_sizes)
