"""DLRM and DLRM-DCNv2 (MLPerf DLRMv2), TorchRec's own modules over one EmbeddingBagCollection.

- ``dlrm``: Naumov et al., 2019 (arXiv:1906.00091). Bottom MLP on the dense features,
  pairwise dot products of the bottom output and the F pooled embeddings, top MLP.
- ``dlrm_dcnv2``: the dot interaction replaced by a low-rank DCN-v2 cross network (Wang et
  al., 2021, arXiv:2008.13535, eq. 2 with ``W = U V^T``):
  ``x_{l+1} = x_0 * (U_l (V_l^T x_l) + b_l) + x_l`` over the concatenated vectors.

Input: dense float32 ``[B, num_dense]``, a KJT of F features; output logits ``[B, 1]``.
"""

from __future__ import annotations

from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.checks import dot_interaction, needs_dense, no_sequences, one_task
from recsys_dist.models.config import DLRMConfig, DLRMDCNConfig
from recsys_dist.models.registry import register_model


def _common(spec: FeatureSpec, cfg: DLRMConfig) -> dict:
    return dict(
        embedding_bag_collection=EmbeddingBagCollection(tables=spec.all_tables(), device=spec.embedding_device),
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=cfg.dense_arch_layer_sizes,
        over_arch_layer_sizes=cfg.over_arch_layer_sizes,
        dense_device=spec.device,
    )


@register_model("dlrm", DLRMConfig, checks=(needs_dense, dot_interaction, one_task, no_sequences))
def build_dlrm(spec: FeatureSpec, cfg: DLRMConfig) -> DLRM:
    """TorchRec's ``DLRM`` over the spec's tables."""
    return DLRM(**_common(spec, cfg))


@register_model("dlrm_dcnv2", DLRMDCNConfig, checks=(needs_dense, one_task, no_sequences))
def build_dlrm_dcnv2(spec: FeatureSpec, cfg: DLRMDCNConfig) -> DLRM_DCN:
    """TorchRec's ``DLRM_DCN`` (MLPerf DLRMv2) over the spec's tables."""
    return DLRM_DCN(dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim, **_common(spec, cfg))
