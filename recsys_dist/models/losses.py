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

from recsys_dist.models.config import REGISTERED_LOSSES, find_loss

LossFn = Callable[..., torch.Tensor]
_LOSSES: dict[str, LossFn] = REGISTERED_LOSSES  # shared with the torch-free config check


def register_loss(name: str, model_outputs: tuple[str, ...] = ()):
    """Decorator that makes ``fn(logits, labels, weights, **kwargs)`` selectable as ``train.loss: <name>``.

    ``model_outputs``: keyword arguments of ``fn`` that the model gives (the entries besides
    ``logits`` of a model that returns a dict, ``recsys_dist.models.task.CTRTask``), not
    ``train.loss_args``; kept as ``fn.model_outputs``.

    Raises:
        ValueError: the name is taken or contains ':'.
    """

    def wrap(fn: LossFn) -> LossFn:
        if ":" in name or name in _LOSSES:
            raise ValueError(f"register_loss: {name!r} is registered already or contains ':'")
        if model_outputs:
            fn.model_outputs = tuple(model_outputs)
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
    return find_loss(name)


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


@register_loss("in_batch_softmax", model_outputs=("candidate_scores", "candidate_ids", "candidate_log_q"))
def in_batch_softmax(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    candidate_scores: torch.Tensor,
    candidate_ids: torch.Tensor,
    candidate_log_q: torch.Tensor,
    positives_only: bool = False,
) -> torch.Tensor:
    """Sampled softmax over in-batch negatives with the logQ correction (Yi et al., 2019,
    "Sampling-Bias-Corrected Neural Modeling for Large Corpus Item Recommendations", RecSys,
    eq. 3 and 4). For a model that returns, besides ``logits``, these extras (``CTRTask``):

    - ``candidate_scores``: float32 ``[B, B]``, ``s(x_i, y_j)``: row i's query against row j's item;
    - ``candidate_ids``: int64 ``[B]``, row j's item id (a repeat of row i's item elsewhere in
      the batch is the same item, not a negative: masked);
    - ``candidate_log_q``: float32 ``[B]``, ``log q_j``, the log of the probability that item j
      is in a batch (zeros: no correction).

    With ``s^c_ij = s_ij - log q_j`` (eq. 3), the loss is the weighted mean over rows of
    ``-r_i log( exp(s^c_ii) / sum_j exp(s^c_ij) )`` (eq. 4), j over the batch's real rows
    (padding rows, weight 0, are neither queries nor candidates). ``r_i`` is 1 for every
    interaction, or the 0/1 label with ``positives_only=True``. A scalar; 0 for a batch
    without positives. ``logits`` is not read (it is the pair score ``s_ii``, for metrics).
    """
    scores = candidate_scores.float() - candidate_log_q.float().unsqueeze(0)  # eq. 3, per column j
    # Masked: accidental hits, and padding columns. The diagonal never is, so every row keeps
    # one finite score (a padding row, weight 0, then adds 0 and a zero gradient, never NaN).
    masked = (candidate_ids.unsqueeze(0) == candidate_ids.unsqueeze(1)) | (weights <= 0).unsqueeze(0)
    masked.fill_diagonal_(False)
    scores = scores.masked_fill(masked, float("-inf"))
    log_p = scores.diagonal() - torch.logsumexp(scores, dim=1)  # [B], eq. 4's log P_B(y_i | x_i)
    w = weights * labels if positives_only else weights
    return -(log_p * w).sum() / weighted_sum_or_one(w)
