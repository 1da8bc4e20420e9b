"""Binary CTR task: logits from a model, weighted log loss, outputs for metrics."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class CTRTask(nn.Module):
    """Wraps a model ``f(dense [B, D], kjt) -> logits [B, 1]`` with the training loss.

    ``forward(batch)`` returns ``(loss, (loss, logits, labels, weights))``: the shape
    TorchRec's train pipelines expect. The loss is the weighted mean of binary
    cross-entropy with logits; rows with weight 0 (padding) contribute nothing, and a
    batch of padding only gives loss 0 with zero gradients.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch):
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        per_example = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        loss = (per_example * batch.weights).sum() / batch.weights.sum().clamp(min=1.0)
        return loss, (loss.detach(), logits.detach(), batch.labels, batch.weights)
