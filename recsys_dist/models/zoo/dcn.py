"""DCN-V2 (Wang et al., 2021, arXiv:2008.13535): a cross network beside or before a deep MLP.

The module and its equations: :class:`DCNv2`.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models import layers, tower
from recsys_dist.models.checks import no_sequences, one_task
from recsys_dist.models.config import DCNv2Config
from recsys_dist.models.registry import register_model


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
        self.deep = layers.mlp(d, deep_layer_sizes, device=device, **mlp_options)
        head_in = deep_layer_sizes[-1] + (d if structure == "parallel" else 0)
        self.head = nn.Linear(head_in, 1, device=device)
        if device is not None:
            self.cross.to(device)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        x0 = torch.cat([dense, layers.pooled_embeddings(self.sparse_arch(kjt), self.features).flatten(1)], dim=1)
        if self.structure == "stacked":
            return self.head(self.deep(self.cross(x0)))
        return self.head(torch.cat([self.cross(x0), self.deep(x0)], dim=1))

    def pipeline_input(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """``x0 = [dense, e_1, ..., e_F]``, ``[B, d]``: what the tower reads (recsys_dist.models.tower)."""
        return torch.cat([dense, layers.pooled_embeddings(self.sparse_arch(kjt), self.features).flatten(1)], dim=1)

    def pipeline_tower(self) -> list[nn.Module]:
        """The cross layers, the deep layers and the head, one module each, over one tensor
        (``recsys_dist.models.tower``): ``tower(pipeline_input(dense, kjt)) == forward(dense, kjt)``."""
        width = self.deep[0].in_features  # d: the deep MLP reads x0 (or the cross output, as wide)
        return tower.cross_then_deep(
            self.cross,
            self.cross._num_layers,
            width,
            tower.mlp_layers(self.deep),
            self.head,
            self.structure == "parallel",
        )


@register_model("dcnv2", DCNv2Config, checks=(one_task, no_sequences))
def build_dcnv2(spec: FeatureSpec, cfg: DCNv2Config) -> DCNv2:
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
