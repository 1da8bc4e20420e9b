"""DLRM and DLRM-DCNv2 (MLPerf DLRMv2), TorchRec's own modules over one EmbeddingBagCollection.

- ``dlrm``: Naumov et al., 2019 (arXiv:1906.00091). Bottom MLP on the dense features,
  pairwise dot products of the bottom output and the F pooled embeddings, top MLP.
- ``dlrm_dcnv2``: the dot interaction replaced by a low-rank DCN-v2 cross network (Wang et
  al., 2021, arXiv:2008.13535, eq. 2 with ``W = U V^T``):
  ``x_{l+1} = x_0 * (U_l (V_l^T x_l) + b_l) + x_l`` over the concatenated vectors.

Input: dense float32 ``[B, num_dense]``, a KJT of F features; output logits ``[B, 1]``.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models import tower
from recsys_dist.models.checks import dot_interaction, needs_dense, no_sequences, one_task
from recsys_dist.models.config import DLRMConfig, DLRMDCNConfig
from recsys_dist.models.registry import register_model


class _Cut:
    """How TorchRec's DLRM / DLRM_DCN is cut into pipeline stages (recsys_dist.models.tower):
    the dense arch and the interaction as one module, then each over-arch layer."""

    def pipeline_input(self, dense: torch.Tensor, kjt) -> torch.Tensor:
        """``[dense, pooled]``: ``[B, D + F*E]``, the pooled embeddings in the sparse arch's order."""
        return torch.cat([dense, self.sparse_arch(kjt).flatten(1)], dim=1)

    def pipeline_tower(self) -> list[nn.Module]:
        """The interaction (dense arch inside), then the over arch's perceptrons and last linear."""
        mlp, last = self.over_arch.model
        first = tower.DLRMInteraction(
            self.dense_arch, self.inter_arch, self.dense_arch.model._mlp[0]._linear.in_features, self.sparse_arch.F
        )
        return [first, *mlp._mlp, last]


class CutDLRM(_Cut, DLRM):
    """TorchRec's ``DLRM`` that says how it is cut into pipeline stages."""


class CutDLRM_DCN(_Cut, DLRM_DCN):
    """TorchRec's ``DLRM_DCN`` that says how it is cut into pipeline stages."""


def _common(spec: FeatureSpec, cfg: DLRMConfig) -> dict:
    return dict(
        embedding_bag_collection=EmbeddingBagCollection(tables=spec.all_tables(), device=spec.embedding_device),
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=cfg.dense_arch_layer_sizes,
        over_arch_layer_sizes=cfg.over_arch_layer_sizes,
        dense_device=spec.device,
    )


@register_model("dlrm", DLRMConfig, checks=(needs_dense, dot_interaction, one_task, no_sequences))
def build_dlrm(spec: FeatureSpec, cfg: DLRMConfig) -> CutDLRM:
    """TorchRec's ``DLRM`` over the spec's tables."""
    return CutDLRM(**_common(spec, cfg))


@register_model("dlrm_dcnv2", DLRMDCNConfig, checks=(needs_dense, one_task, no_sequences))
def build_dlrm_dcnv2(spec: FeatureSpec, cfg: DLRMDCNConfig) -> CutDLRM_DCN:
    """TorchRec's ``DLRM_DCN`` (MLPerf DLRMv2) over the spec's tables."""
    return CutDLRM_DCN(dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim, **_common(spec, cfg))
