"""Optimizers: the embedding optimizer fused into backward (FBGEMM), the dense one separate."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.optim import optimizers as trec_optim
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recsys_dist.config import RunConfig

# torchrec optimizer classes map to FBGEMM's EmbOptimType when the tables are sharded:
# RowWiseAdagrad -> EXACT_ROWWISE_ADAGRAD, Adagrad -> EXACT_ADAGRAD, SGD -> EXACT_SGD, Adam -> ADAM.
EMBEDDING_OPTIMIZERS = {
    "exact_rowwise_adagrad": (RowWiseAdagrad, {"eps": 1e-8}),
    "exact_adagrad": (trec_optim.Adagrad, {"eps": 1e-8}),
    "exact_sgd": (trec_optim.SGD, {}),
    "adam": (trec_optim.Adam, {"eps": 1e-8}),
}
DENSE_OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def fuse_embedding_optimizer(embedding_module: nn.Module, cfg: RunConfig) -> None:
    """Mark every table parameter for ``train.embedding_optimizer``, applied in backward.

    Must run before sharding: the sharder reads the mark to build FBGEMM's fused kernel,
    and the planner uses it to count optimizer state in its memory estimate.
    """
    cls, kwargs = EMBEDDING_OPTIMIZERS[cfg.train.embedding_optimizer]
    apply_optimizer_in_backward(cls, embedding_module.parameters(), {"lr": cfg.train.embedding_lr, **kwargs})
