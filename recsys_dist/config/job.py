"""``RunConfig`` -> :class:`~recsys_dist.train.job.Job`: the one place the root config is resolved.

Only the command line and the public API (``recsys_dist.Trainer(cfg)``, ``recsys_dist.resolve_job``)
hold a ``RunConfig``; they resolve it here once and hand the Job down.
"""

from __future__ import annotations

from recsys_dist.config.run import RunConfig
from recsys_dist.data.convert import PreparedData
from recsys_dist.train.job import SECTIONS, Job, build_job


def resolve_job(
    cfg: RunConfig,
    prepared: PreparedData | None = None,
    world_size: int | None = None,
    given_model: bool = False,
    sizes: list[int] | None = None,
) -> Job:
    """The :class:`Job` of a validated config: its sections, format object, FeatureSpec (tables on
    ``meta``; sized as ``sizes`` gives, else as ``prepared`` decided, else as configured),
    registered model (``given_model``: the model given to ``Trainer(model=...)``) and world size
    (``world_size``: torchrun's, else ``distributed.nproc_per_node``).

    Raises:
        TypeError: ``cfg`` is not a ``RunConfig``.
    """
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"expected a RunConfig (recsys_dist.load_config), got {type(cfg).__name__}")
    sections = {name: getattr(cfg, name) for name in SECTIONS}
    return build_job(sections, prepared, world_size, given_model, sizes)
