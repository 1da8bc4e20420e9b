"""Training losses by name (``train.loss``) or import path, with the signature every loss has.

A loss is ``fn(logits, labels, weights, **train.loss_args) -> Tensor[]`` (a scalar):

- ``logits``: float32 ``[B]`` (one task) or ``[B, T]``; the model's raw outputs.
- ``labels``: float32 ``[B]`` (``[B, T]`` with several tasks): 0/1 for binary losses.
- ``weights``: float32 ``[B]``, 0 for padding rows, which must not contribute. Divide by
  ``weighted_sum_or_one(weights)`` (``weights.sum()``, or 1 for a batch of padding only, which
  then gives 0 with zero gradients): the trainer's ``loss_scale`` assumes exactly this
  denominator when it turns each rank's weighted mean into the global batch's.

The function runs inside the model's forward, which TrainPipelineSparseDist traces with
torch.fx: it may use tensor operations freely, but no Python control flow on tensor values
(``if loss > 0``), ``len()`` of a tensor or iteration over one (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[..., torch.Tensor]
_LOSSES: dict[str, LossFn] = {}


def register_loss(name: str):
    """Decorator that makes ``fn(logits, labels, weights, **kwargs)`` selectable as ``train.loss: <name>``.

    Raises:
        ValueError: the name is taken or contains ':'.
    """

    def wrap(fn: LossFn) -> LossFn:
        if ":" in name or name in _LOSSES:
            raise ValueError(f"register_loss: {name!r} is registered already or contains ':'")
        _LOSSES[name] = fn
        return fn

    return wrap


def loss_names() -> list[str]:
    """Every registered loss name, sorted."""
    return sorted(_LOSSES)


def get_loss(name: str) -> LossFn:
    """The loss registered as ``name``, or the function at import path ``"package.module:fn"``.

    Raises:
        ValueError: unknown name, or an import path that does not resolve to a callable.
    """
    from recsys_dist.config.base import import_object, is_import_path

    if is_import_path(name):
        fn = import_object(name, "train.loss")
        if not callable(fn):
            raise ValueError(f"train.loss: {name} is not callable")
        return fn
    if name not in _LOSSES:
        raise ValueError(
            f"train.loss: unknown loss {name!r}; registered: {', '.join(loss_names())}, or 'package.module:fn'"
        )
    return _LOSSES[name]


def weighted_sum_or_one(weights: torch.Tensor) -> torch.Tensor:
    """``weights.sum()``, or 1 where it is 0 (a batch of padding only): the denominator of a
    loss's weighted mean. Not ``clamp(min=1)``: sample weights below 1 are exact too."""
    total = weights.sum()
    return torch.where(total > 0, total, torch.ones_like(total))


def _weighted_mean(per_example: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if per_example.dim() > 1:  # [B, T]: every task of a row shares the row's weight
        per_example = per_example.mean(dim=1)
    return (per_example * weights).sum() / weighted_sum_or_one(weights)


@register_loss("bce")
def bce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy on logits, weighted mean over rows: the CTR log loss."""
    return _weighted_mean(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"), weights)


@register_loss("focal")
def focal(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, gamma: float = 2.0, alpha: float | None = None
) -> torch.Tensor:
    """Focal loss (Lin et al., 2017, arXiv:1708.02002, eq. 5): ``-alpha_t (1 - p_t)^gamma log(p_t)``,
    with ``p_t = p`` for a positive and ``1 - p`` for a negative; ``alpha`` None = no class
    weighting. ``gamma = 0`` (and no alpha) is binary cross-entropy."""
    ce = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    p = torch.sigmoid(logits)
    p_t = p * labels + (1 - p) * (1 - labels)
    loss = ce * (1 - p_t).pow(gamma)
    if alpha is not None:
        loss = loss * (alpha * labels + (1 - alpha) * (1 - labels))
    return _weighted_mean(loss, weights)


@register_loss("mse")
def mse(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Squared error of the raw output against the label, weighted mean over rows (regression)."""
    return _weighted_mean((logits - labels).pow(2), weights)
