"""Build a configured model on any device (``meta`` before sharding)."""

from __future__ import annotations

import math

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_dist.config import RunConfig
from recsys_dist.data.criteo import DENSE_NAMES, SPARSE_NAMES
from recsys_dist.models.task import CTRTask


def table_sizes(cfg: RunConfig) -> list[int]:
    n = cfg.data.num_embeddings
    return list(n) if isinstance(n, list) else [n] * len(SPARSE_NAMES)


def embedding_configs(cfg: RunConfig) -> list[EmbeddingBagConfig]:
    """One table per categorical feature, ``t_<feature>``, sum pooling."""
    scale = cfg.model.embedding_init_scale
    out = []
    for name, rows in zip(SPARSE_NAMES, table_sizes(cfg)):
        s = scale if scale is not None else math.sqrt(1.0 / rows)
        out.append(
            EmbeddingBagConfig(
                name=f"t_{name}",
                embedding_dim=cfg.model.embedding_dim,
                num_embeddings=rows,
                feature_names=[name],
                pooling=PoolingType.SUM,
                weight_init_min=-s,
                weight_init_max=s,
            )
        )
    return out


def build_model(cfg: RunConfig, device: torch.device) -> CTRTask:
    """DLRM (Naumov et al., 2019, arXiv:1906.00091) with dot interaction.

    Input: dense float32 [B, 13], KJT of 26 one-hot features; output logits [B, 1].
    Dense parameters are initialised on ``device`` from the current torch seed.
    """
    ebc = EmbeddingBagCollection(tables=embedding_configs(cfg), device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=len(DENSE_NAMES),
        dense_arch_layer_sizes=cfg.model.dense_arch_layer_sizes,
        over_arch_layer_sizes=cfg.model.over_arch_layer_sizes,
        dense_device=device,
    )
    return CTRTask(dlrm)
