"""A model and a loss that live outside recsys_dist, named by import path in YAML.

Run from the repository root::

    PYTHONPATH=examples/custom_model recsys-dist train --config examples/custom_model/config.yaml

``DotTower`` is a small DLRM-like model written against the public contract
(docs/api.md): ``factory(spec, **model.args)`` returns an ``nn.Module`` whose
``forward(dense [B, num_dense] float32, sparse KeyedJaggedTensor)`` returns logits ``[B]``.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor


# TrainPipelineSparseDist traces forward with torch.fx; reads by key (kt[k], kt.to_dict()[k])
# trace as they are (docs/api.md). One leaf here keeps the F reads and the stack one graph node.
@torch.fx.wrap
def pooled(kt: KeyedTensor, keys: list[str]) -> torch.Tensor:
    """[B, F, E] pooled embeddings of ``keys``, in that order."""
    per_key = kt.to_dict()
    return torch.stack([per_key[k] for k in keys], dim=1)


class DotTower(nn.Module):
    """Dense features projected to one vector, pairwise dot products with the F pooled
    embeddings (Naumov et al., 2019, DLRM's interaction), then an MLP to one logit."""

    def __init__(self, spec, hidden: int = 64) -> None:
        super().__init__()
        dim = spec.embedding_dim
        self.keys = list(spec.sparse_names)
        self.ebc = EmbeddingBagCollection(tables=spec.tables, device=spec.embedding_device)
        self.bottom = nn.Linear(max(spec.num_dense, 1), dim, device=spec.device)
        n = len(self.keys) + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1, device=spec.device), persistent=False)
        self.top = nn.Sequential(
            nn.Linear(n * (n - 1) // 2 + dim, hidden, device=spec.device),
            nn.ReLU(),
            nn.Linear(hidden, 1, device=spec.device),
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        x = self.bottom(dense)  # [B, E]
        vectors = torch.cat([x.unsqueeze(1), pooled(self.ebc(sparse), self.keys)], dim=1)  # [B, F + 1, E]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(-1)  # [B]


def focal_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Focal loss (Lin et al., 2017, eq. 5, no alpha): rows weighted by ``weights`` (0 = padding)."""
    ce = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    p_t = torch.exp(-ce)
    return (ce * (1 - p_t).pow(gamma) * weights).sum() / weights.sum().clamp(min=1.0)
