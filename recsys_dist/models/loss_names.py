"""The losses ``train.loss`` may name, without torch: the shipped losses' keyword parameters as
constants, and the table ``recsys_dist.models.losses.register_loss`` fills. The config check of
``train.loss`` / ``train.loss_args`` (``recsys_dist.train.config``) reads these, so loading a
config imports no training code; tests/training/test_loss_names.py checks the constants against
the shipped losses' signatures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from recsys_dist.config.base import import_object, is_import_path


@dataclass(frozen=True)
class LossParams:
    """The keyword parameters of a loss ``fn(logits, labels, weights, ...)`` after the first three.

    Attributes:
        required: parameters without a default: ``train.loss_args`` must give them.
        optional: parameters with a default.
        model_outputs: parameters the model's output gives (``register_loss(model_outputs=...)``),
            never ``train.loss_args``.
        takes_kwargs: the loss takes ``**kwargs`` (any ``train.loss_args`` key).
    """

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    model_outputs: tuple[str, ...] = ()
    takes_kwargs: bool = False


SHIPPED_LOSSES: dict[str, LossParams] = {
    "bce": LossParams(),
    "focal": LossParams(optional=("gamma", "alpha")),
    "mse": LossParams(),
    "in_batch_softmax": LossParams(
        optional=("positives_only",), model_outputs=("candidate_scores", "candidate_ids", "candidate_log_q")
    ),
}
"""The losses of ``recsys_dist.models.losses`` by name."""

REGISTERED_LOSSES: dict[str, Callable] = {}
"""``{name: fn}`` of every ``register_loss`` call: the shipped losses once
``recsys_dist.models.losses`` is imported, and the user's."""


def registered_loss_names() -> list[str]:
    """Every loss name ``train.loss`` may give (shipped or registered), sorted."""
    return sorted({*SHIPPED_LOSSES, *REGISTERED_LOSSES})


def find_loss(name: str) -> Callable:
    """The loss registered as ``name``, or the function at import path ``"package.module:fn"``
    (importing the user's module).

    Raises:
        ValueError: unknown name (a shipped loss is unknown here until
            ``recsys_dist.models.losses`` is imported), or an import path that does not resolve
            to a callable.
    """
    if is_import_path(name):
        fn = import_object(name, "train.loss")
        if not callable(fn):
            raise ValueError(f"train.loss: {name} is not callable")
        return fn
    if name not in REGISTERED_LOSSES:
        raise ValueError(
            f"train.loss: unknown loss {name!r}; registered: {', '.join(registered_loss_names())}, "
            "or 'package.module:fn'"
        )
    return REGISTERED_LOSSES[name]
