"""The torch-free table of the shipped losses (``recsys_dist.models.config.SHIPPED_LOSSES``, read by the
``train.loss`` config check) equals the shipped losses' signatures."""

import inspect

from recsys_dist.models import losses
from recsys_dist.models.config import SHIPPED_LOSSES, LossParams


def _params(fn) -> LossParams:
    params = list(inspect.signature(fn).parameters.values())[3:]
    given = tuple(getattr(fn, "model_outputs", ()))
    rest = [p for p in params if p.name not in given]
    return LossParams(
        required=tuple(p.name for p in rest if p.default is p.empty),
        optional=tuple(p.name for p in rest if p.default is not p.empty),
        model_outputs=given,
        takes_kwargs=any(p.kind is p.VAR_KEYWORD for p in params),
    )


def test_the_table_equals_the_shipped_losses():
    shipped = {n: fn for n, fn in losses._LOSSES.items() if fn.__module__ == losses.__name__}
    assert {n: _params(fn) for n, fn in shipped.items()} == SHIPPED_LOSSES
