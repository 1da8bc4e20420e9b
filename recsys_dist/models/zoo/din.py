"""DIN (Zhou et al., 2018, arXiv:1706.06978): target attention over the user's history.

The module and its equations: :class:`DIN`. Pooled tables in one
EmbeddingBagCollection, sequence tables in one EmbeddingCollection: both sharded.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.checks import no_history_extras, one_task
from recsys_dist.models.config import DINConfig
from recsys_dist.models.layers import mlp_head
from recsys_dist.models.registry import register_model
from recsys_dist.models.sequence import TargetSequenceModel


class DIN(TargetSequenceModel):
    """Deep Interest Network (Zhou et al., 2018, KDD, arXiv:1706.06978), eq. 3 and Fig. 2.

    For each sequence feature with positions ``e_1..e_L`` [B, L, E] and the target item's
    embedding ``v_A`` [B, E] (the pooled embedding of ``target_feature``):

    ``w_j = a(e_j, v_A) = MLP_att([e_j, v_A, e_j - v_A, e_j * v_A])`` (the local activation
    unit; the paper's out-product is taken element-wise here, as in its public code), and
    ``v_U(A) = sum_j w_j e_j`` over real positions (eq. 3; no softmax, so the weights keep the
    intensity of the interest). Then ``logit = MLP([dense, e_1..e_F, v_U per sequence])``,
    with ``e_1..e_F`` the pooled embeddings of every sparse feature. An empty history gives
    ``v_U = 0``. Dice and the mini-batch-aware regulariser of the paper are not used
    (ReLU / PReLU-free MLP and the configured optimizers).
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        ec: EmbeddingCollection,
        num_dense: int,
        features: list[str],
        sequences: list[str],
        target_feature: str,
        embedding_dim: int,
        deep_layer_sizes: list[int],
        attention_sizes: list[int],
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__(ebc, ec, features, sequences, target_feature)
        self.attention = nn.ModuleList(
            mlp_head(
                4 * embedding_dim, attention_sizes, device=device, activation=mlp_options.get("activation", "relu")
            )
            for _ in sequences
        )
        d = num_dense + (len(features) + len(sequences)) * embedding_dim
        self.deep = mlp_head(d, deep_layer_sizes, device=device, **mlp_options)

    def interest(self, att: nn.Module, values: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[B, E]: ``sum_j w_j e_j`` over real positions (eq. 3)."""
        t = target.unsqueeze(1).expand_as(values)
        w = att(torch.cat([values, t, values - t, values * t], dim=-1)).squeeze(-1) * mask  # [B, L]
        return (w.unsqueeze(-1) * values).sum(dim=1)

    def summarise(self, i: int, values: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.interest(self.attention[i], values, mask, target)


@register_model("din", DINConfig, checks=(one_task, no_history_extras))
def build_din(spec: FeatureSpec, cfg: DINConfig) -> DIN:
    """``DIN`` over the spec's pooled tables and its sequence tables.

    Raises:
        ValueError: no sequence feature, or ``target_feature`` is not a categorical feature.
    """
    return DIN.from_spec(spec, cfg, cfg.attention_sizes)
