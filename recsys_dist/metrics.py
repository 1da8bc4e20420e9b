"""Exact global binary-classification metrics over all ranks' predictions.

Predictions are gathered from every rank (padding rows, weight 0, are removed) and the
metrics are computed once on the full set, never averaged per rank.

- AUC: probability that a random positive scores above a random negative, ties counted
  one half; computed from average ranks (Mann-Whitney U). Equals
  ``sklearn.metrics.roc_auc_score``.
- logloss: mean of ``-(y log p + (1-y) log(1-p))``, computed from logits for stability.
- NE (normalized entropy, He et al., 2014): logloss divided by the entropy of the base
  click rate ``-(c log c + (1-c) log(1-c))``, ``c`` = mean label.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC of float scores [N] against {0,1} labels [N]; NaN if one class is absent."""
    scores = scores.double().flatten()
    labels = labels.double().flatten()
    n_pos = float(labels.sum())
    n_neg = float(labels.numel() - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    # Average rank for tied scores: rank of a tie group = mean of its 1-based positions.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = (ends - (counts.double() - 1) / 2)[inverse]
    pos_rank_sum = float((avg_rank * labels[order]).sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def logloss_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))


def normalized_entropy(logloss: float, labels: torch.Tensor) -> float:
    c = float(labels.double().mean())
    if c <= 0.0 or c >= 1.0:
        return float("nan")
    return logloss / -(c * math.log(c) + (1 - c) * math.log(1 - c))


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC, logloss, NE, calibration, accuracy and the count of a set of predictions."""
    probs = torch.sigmoid(logits.double())
    ll = logloss_from_logits(logits, labels)
    return {
        "auc": auc(logits, labels),
        "logloss": ll,
        "ne": normalized_entropy(ll, labels),
        "calibration": float(probs.mean() / labels.double().mean()) if labels.sum() > 0 else float("nan"),
        "accuracy": float(((probs > 0.5).double() == labels.double()).double().mean()),
        "num_examples": int(labels.numel()),
    }


def gather_predictions(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' (logits, labels) for rows with weight > 0, identical on every rank.

    Tensors are 1-D float on any device; results are on CPU. Works without a process group.
    """
    keep = weights > 0
    local = torch.stack([logits[keep].float(), labels[keep].float()]).cpu()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local[0], local[1]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    both = torch.cat(parts, dim=1)
    return both[0], both[1]
