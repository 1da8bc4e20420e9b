"""Build a configured model on any device (``meta`` before sharding)."""

from __future__ import annotations

import math

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_dist.config import RunConfig
from recsys_dist.data import feature_names
from recsys_dist.models.ctr import DCNv2, DeepFM, WideDeep, XDeepFM
from recsys_dist.models.task import CTRTask


def table_sizes(cfg: RunConfig) -> list[int]:
    n = cfg.data.num_embeddings
    return list(n) if isinstance(n, list) else [n] * len(feature_names(cfg)[1])


def _pooling(cfg: RunConfig, table: str) -> str:
    override = cfg.sharding.per_table.get(table)
    return (override.pooling if override and override.pooling else None) or cfg.sharding.pooling


# FBGEMM's fused kernel needs widths that are multiples of 4, so a per-id scalar weight
# (first-order / wide part) is stored as 4 columns that the model averages.
FIRST_ORDER_DIM = 4


def table_names(cfg: RunConfig) -> list[str]:
    """Every table of the configured model: ``t_<feature>`` (+ ``w_<feature>`` first-order)."""
    return [t.name for t in embedding_configs(cfg)]


def embedding_configs(cfg: RunConfig, prefix: str | None = None) -> list[EmbeddingBagConfig]:
    """One table per categorical feature, ``t_<feature>`` (dim ``model.embedding_dim``), and
    for deepfm / wide_deep one first-order table ``w_<feature>`` each; pooling from
    ``sharding.pooling`` / ``sharding.per_table``. ``prefix`` selects one group."""
    if prefix is None:
        groups = ["t_"] + (["w_"] if cfg.model.name in ("deepfm", "wide_deep", "xdeepfm") else [])
        return [c for g in groups for c in embedding_configs(cfg, g)]
    scale = cfg.model.embedding_init_scale
    out = []
    for name, rows in zip(feature_names(cfg)[1], table_sizes(cfg)):
        s = scale if scale is not None else math.sqrt(1.0 / rows)
        out.append(
            EmbeddingBagConfig(
                name=f"{prefix}{name}",
                embedding_dim=cfg.model.embedding_dim if prefix == "t_" else FIRST_ORDER_DIM,
                num_embeddings=rows,
                feature_names=[name],
                pooling=PoolingType.MEAN if _pooling(cfg, f"{prefix}{name}") == "mean" else PoolingType.SUM,
                weight_init_min=-s,
                weight_init_max=s,
            )
        )
    return out


def build_model(cfg: RunConfig, device: torch.device, tables_device: torch.device | None = None) -> CTRTask:
    """DLRM or DLRM-DCNv2 over one EmbeddingBagCollection, wrapped with the CTR loss.

    - ``dlrm``: Naumov et al., 2019 (arXiv:1906.00091). Bottom MLP on dense features, pairwise
      dot products of the 27 vectors (bottom output + 26 pooled embeddings), top MLP.
    - ``dlrm_dcnv2``: the MLPerf DLRMv2 model. The dot interaction is replaced by a low-rank
      DCN-v2 cross network (Wang et al., 2021, arXiv:2008.13535, eq. 2 with W = U V^T):
      ``x_{l+1} = x_0 * (U_l (V_l^T x_l) + b_l) + x_l`` over the concatenated vectors.

    Input: dense float32 [B, 13], KJT of 26 features; output logits [B, 1]. The tables stay
    on ``meta`` (sharding materialises them) unless ``tables_device`` is given (an unsharded
    model, e.g. for export); dense parameters are created on ``device`` from the torch seed.
    """
    tdev = tables_device or torch.device("meta")

    def task(model: torch.nn.Module) -> CTRTask:
        return CTRTask(model, device.type if cfg.train.precision == "bf16-mixed" else None)

    # Every model has one collection; DeepFM's family adds its first-order tables to it.
    ebc = EmbeddingBagCollection(tables=embedding_configs(cfg), device=tdev)
    dense_names, sparse_names = feature_names(cfg)
    m, num_dense = cfg.model, len(dense_names)
    opts = dict(dropout=m.dropout, norm=m.norm, activation=m.activation, init_std=m.mlp_init_std)
    if m.name == "dcnv2":
        return task(
            DCNv2(
                ebc,
                num_dense,
                sparse_names,
                m.embedding_dim,
                m.deep_layer_sizes,
                m.dcn_num_layers,
                m.cross_low_rank_dim,
                m.dcn_structure,
                device=device,
                **opts,
            )
        )
    if m.name == "xdeepfm":
        return task(
            XDeepFM(
                ebc,
                num_dense,
                sparse_names,
                m.embedding_dim,
                m.deep_layer_sizes,
                m.cin_layer_sizes,
                device=device,
                **opts,
            )
        )
    if m.name in ("deepfm", "wide_deep"):
        cls = DeepFM if m.name == "deepfm" else WideDeep
        return task(cls(ebc, num_dense, sparse_names, m.embedding_dim, m.deep_layer_sizes, device=device, **opts))
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=cfg.model.dense_arch_layer_sizes,
        over_arch_layer_sizes=cfg.model.over_arch_layer_sizes,
        dense_device=device,
    )
    if cfg.model.name == "dlrm_dcnv2":
        model = DLRM_DCN(dcn_num_layers=cfg.model.dcn_num_layers, dcn_low_rank_dim=cfg.model.dcn_low_rank_dim, **common)
    else:
        model = DLRM(**common)
    return task(model)
