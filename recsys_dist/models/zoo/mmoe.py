"""MMoE: Multi-gate Mixture-of-Experts (Ma et al., 2018, "Modeling Task Relationships in
Multi-task Learning with Multi-gate Mixture-of-Experts", KDD, doi:10.1145/3219819.3220007).

Input ``x = [dense, e_1, ..., e_F]`` (the pooled embeddings of one EmbeddingBagCollection,
sharded like every other table), of width ``d = D_dense + F*E``. With ``n`` experts
``f_i`` (MLPs, ``expert_sizes``) and one gate and tower per task ``k`` (eq. 5-7)::

    g^k(x) = softmax(W_gk x)                   W_gk: [n, d]       (eq. 6)
    f^k(x) = sum_{i=1..n} g^k(x)_i f_i(x)                          (eq. 5)
    y_k    = h^k(f^k(x))                       h^k: MLP (tower_sizes) -> 1 logit   (eq. 7)

Output: logits float32 ``[B, T]``, one column per task of ``spec.tasks`` (``data.schema.labels``
order; a binary task's logit goes through a sigmoid, a regression task's is its prediction).
Sequence features, if the data has any, are not read.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.spec import FeatureSpec

# layers.pooled_embeddings, called through its module: torch.fx.wrap makes it a leaf of the
# pipeline's trace by patching that name in layers' namespace, which a name imported here would miss.
from recsys_dist.models import layers
from recsys_dist.models.checks import no_sequences
from recsys_dist.models.config import MMoEConfig
from recsys_dist.models.layers import mlp, mlp_head
from recsys_dist.models.registry import register_model


def mix(gate: nn.Linear, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``softmax(gate(x))^T experts``: x [B, d] and the n experts' outputs [B, n, H] -> [B, H]
    (eq. 5-6; PLE's eq. 2-3)."""
    w = torch.softmax(gate(x), dim=1)  # [B, n]
    return (w.unsqueeze(2) * experts).sum(dim=1)


class MMoE(nn.Module):
    """The MMoE network of the module docstring over one EmbeddingBagCollection.

    ``forward(dense float32 [B, D], kjt) -> logits float32 [B, T]``.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        num_dense: int,
        features: list[str],
        embedding_dim: int,
        num_tasks: int,
        num_experts: int,
        expert_sizes: list[int],
        tower_sizes: list[int],
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__()
        self.sparse_arch, self.features = ebc, features
        d = num_dense + len(features) * embedding_dim
        self.experts = nn.ModuleList(mlp(d, expert_sizes, device=device, **mlp_options) for _ in range(num_experts))
        self.gates = nn.ModuleList(nn.Linear(d, num_experts, device=device) for _ in range(num_tasks))
        self.towers = nn.ModuleList(
            mlp_head(expert_sizes[-1], tower_sizes, device=device, **mlp_options) for _ in range(num_tasks)
        )

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([dense, layers.pooled_embeddings(self.sparse_arch(kjt), self.features).flatten(1)], dim=1)
        experts = torch.stack([f(x) for f in self.experts], dim=1)  # [B, n, H]
        return torch.cat([tower(mix(gate, x, experts)) for gate, tower in zip(self.gates, self.towers)], dim=1)  # eq. 7


@register_model("mmoe", MMoEConfig, checks=(no_sequences,))
def build_mmoe(spec: FeatureSpec, cfg: MMoEConfig) -> MMoE:
    """``MMoE`` over the spec's pooled tables, one gate and tower per task of ``spec.tasks``."""
    return MMoE(
        EmbeddingBagCollection(tables=spec.all_tables(), device=spec.embedding_device),
        spec.num_dense,
        spec.sparse_names,
        cfg.embedding_dim,
        len(spec.tasks),
        cfg.num_experts,
        cfg.deep_layer_sizes,
        cfg.tower_sizes,
        device=spec.device,
        **cfg.mlp_kwargs(),
    )
