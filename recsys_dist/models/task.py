"""Binary CTR task: logits from a model, weighted log loss, outputs for metrics."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class CTRTask(nn.Module):
    """Wraps a model ``f(dense [B, D], kjt) -> logits [B, 1]`` with the training loss.

    ``forward(batch)`` returns ``(loss, (loss, logits, labels, weights))``: the shape
    TorchRec's train pipelines expect. The loss is the weighted mean of binary
    cross-entropy with logits; rows with weight 0 (padding) contribute nothing, and a
    batch of padding only gives loss 0 with zero gradients.

    ``bf16_device``: a device type ("cpu", "cuda"); the model's forward then runs under
    ``torch.autocast`` with bfloat16 (mixed precision: matmuls in bfloat16, parameters and
    gradients float32). The type is fixed here, not read from the batch, because
    TrainPipelineSparseDist traces this forward with torch.fx. Logits and the loss are
    float32 either way.
    """

    def __init__(self, model: nn.Module, bf16_device: str | None = None) -> None:
        super().__init__()
        self.model, self.bf16_device = model, bf16_device

    def forward(self, batch):
        mixed = self.bf16_device is not None
        with torch.autocast(self.bf16_device, dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
            logits = self.model(batch.dense_features, batch.sparse_features)
        logits = logits.squeeze(-1).float()
        per_example = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        loss = (per_example * batch.weights).sum() / batch.weights.sum().clamp(min=1.0)
        return loss, (loss.detach(), logits.detach(), batch.labels, batch.weights)
