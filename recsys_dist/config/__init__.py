"""The typed run config: one tree of sections, loaded strictly from YAML plus dotted overrides.

Every section is a pydantic model with ``extra="forbid"`` owned by its component
(``DataConfig`` in ``recsys_dist.data.config``, ``ModelConfig`` and the per-model classes in
``recsys_dist.models``, ``TrainConfig``, ``DistributedConfig``, ``ShardingConfig``,
``CheckpointConfig``, ``EvalConfig``). An unknown key, a wrong type or an impossible value is
a :class:`ConfigError` naming the dotted key, the value given and what is allowed; all
problems are reported together, before any process is spawned.

``base`` (the error and the section base) imports nothing of the package, so components can
define their sections on it; ``run`` composes them into ``RunConfig``; ``loader`` reads YAML and
dotted overrides; ``reference`` writes docs/config.md from the sections; ``job`` resolves a
``RunConfig`` into the ``recsys_dist.train.job.Job`` that every component receives. ``run``,
``loader``, ``reference`` and ``job`` sit above every component (tests/unit/api/test_layers.py):
no component takes the root config. The loader and ``RunConfig`` load lazily here (type
checkers read ``__init__.pyi``).
"""

from recsys_dist.section import ConfigError, Section

__all__ = [
    "ConfigError",
    "RunConfig",
    "Section",
    "config_from_dict",
    "load_config",
    "parse_overrides",
    "save_config",
]


def __getattr__(name: str) -> object:
    if name == "RunConfig":
        # lazy API: importing the config package must not load the sections
        from recsys_dist.config.run import RunConfig

        return RunConfig
    if name in __all__:
        from recsys_dist.config import loader  # lazy API, as above

        return getattr(loader, name)
    raise AttributeError(f"module 'recsys_dist.config' has no attribute {name!r}")
