"""The resolved run: a :class:`Job` holds each config section and the facts resolved from them
once (the format object, the FeatureSpec, the registered model, the world), so that no component
re-derives them or takes the root config.

The command line resolves a ``RunConfig`` into a Job once (``recsys_dist.config.job.resolve_job``),
preflight checks it once (``recsys_dist.train.preflight.check_before_launch``), and the ranks it
starts receive it (pickled to a spawned rank, inherited by a forked one). ``serve`` rebuilds one
from a run's saved config (:func:`load_job`). Components take their own section plus the facts:
``build_model(job.model, job.features, job.train)``, ``make_loaders(job, ctx)``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from pydantic import ValidationError

from recsys_dist.checkpoint.config import CheckpointConfig
from recsys_dist.data.config import DataConfig, describe_raw_path
from recsys_dist.data.convert import PreparedData
from recsys_dist.data.formats.base import RawFormat
from recsys_dist.data.mapping import NO_TABLE_ROWS
from recsys_dist.data.resolve import check_data, configured_sizes, data_format, prepare_from_config
from recsys_dist.data.spec import FeatureSpec
from recsys_dist.distributed.config import DistributedConfig, ShardingConfig
from recsys_dist.errors import DataError
from recsys_dist.files import write_atomic
from recsys_dist.models.build import feature_spec
from recsys_dist.models.config import ModelConfig
from recsys_dist.models.registry import GIVEN_MODEL, ModelSpec, get_model, model_config_class
from recsys_dist.section import IMPORT_USER_CODE, ConfigError, Section, format_validation_errors
from recsys_dist.train.config import EvalConfig, PublishConfig, TrainConfig

# The run's sections, in config order: one source of names (``RunConfig`` composes the same ones;
# tests/unit/config/test_config.py checks it). ``model`` validates against the chosen model's class.
SECTIONS: dict[str, type[Section]] = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "distributed": DistributedConfig,
    "sharding": ShardingConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "publish": PublishConfig,
}


@dataclass(frozen=True)
class World:
    """The job's size: ``nproc`` ranks on this machine (``distributed.nproc_per_node``),
    ``size`` ranks in all (torchrun's ``WORLD_SIZE`` when known, else ``nproc``)."""

    nproc: int
    size: int


@dataclass(frozen=True)
class Job:
    """A run resolved once: its sections, and the facts every component used to re-derive.

    Attributes:
        data, model, train, distributed, sharding, checkpoint, eval, publish: the validated
            config sections (``model``: an instance of the chosen model's config class).
        fmt: the format object of ``data.format`` with its options, built once.
        features: the run's FeatureSpec, tables on ``meta``: dense / sparse / sequence names,
            tasks and their kinds, label and weight columns, managed features, and the table
            sizes (as configured until the data is converted, then the sizes the conversion
            decided: :meth:`with_data`).
        model_spec: the registered model ``model.name`` names (None for an import-path model that
            cannot be loaded here: validation reports it), or ``GIVEN_MODEL`` for the model given
            to ``Trainer(model=...)`` (no checks, no hooks).
        world: the job's size.
        prepared: the converted data (``PreparedData``), once converted; None before.
    """

    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    distributed: DistributedConfig
    sharding: ShardingConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    publish: PublishConfig
    fmt: RawFormat
    features: FeatureSpec
    model_spec: ModelSpec | None
    world: World
    prepared: PreparedData | None = None

    @property
    def table_sizes(self) -> list[int]:
        """Rows of every feature's table (sequence features last), as the loaders bound ids."""
        f = self.features
        return [t.num_embeddings for t in f.tables + f.sequence_tables] + [NO_TABLE_ROWS] * len(f.value_names)

    def sections(self) -> dict[str, Section]:
        """``{name: section}`` in config order."""
        return {name: getattr(self, name) for name in SECTIONS}

    def to_dict(self) -> dict[str, Any]:
        """Every key with its resolved value, as plain JSON types (what ``config.yaml`` holds)."""
        return {name: s.model_dump(mode="json") for name, s in self.sections().items()}

    def save_config(self, path) -> None:
        """Write :meth:`to_dict` as YAML, atomically (a symbolic link at ``path`` is replaced,
        never written through: ``recsys_dist.files``)."""
        write_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    def with_data(self, prepared: PreparedData) -> Job:
        """This job over converted data: its table sizes are the ones the conversion decided
        (under vocabulary mapping the vocabularies' sizes, else the configured ones)."""
        if prepared is self.prepared:
            return self
        sizes = _sizes(self.data, self.fmt, prepared)
        features = self.features
        if sizes != self.table_sizes:
            features = self.features_sized(sizes)
        return dataclasses.replace(self, features=features, prepared=prepared)

    def features_sized(self, sizes: list[int]) -> FeatureSpec:
        """The FeatureSpec with tables of ``sizes`` rows (per feature of ``fmt.sparse_names``),
        tables on ``meta``, through the model's ``on_features`` hook."""
        hook = self.model_spec.on_features if self.model_spec is not None else None
        return feature_spec(
            self.fmt, self.data, self.model, sizes, torch.device("cpu"), torch.device("meta"), on_features=hook
        )

    def given_model(self) -> Job:
        """This job training the model given to ``Trainer(model=...)`` instead of ``model.name``'s:
        no checks and no hooks of ``model.name``'s (its FeatureSpec without ``on_features``' tables)."""
        if self.model_spec is GIVEN_MODEL:
            return self
        given = dataclasses.replace(self, model_spec=GIVEN_MODEL)
        return dataclasses.replace(given, features=given.features_sized(self._sizes_in_format_order()))

    def _sizes_in_format_order(self) -> list[int]:
        rows = {t.feature_names[0]: t.num_embeddings for t in self.features.tables + self.features.sequence_tables}
        return [rows[k] for k in self.fmt.sparse_names]

    def __reduce__(self):
        # A spawned rank gets the sections, features, world and data; the format object and the
        # model's registry entry (which may hold closures) are looked up again there.
        given = self.model_spec is GIVEN_MODEL
        return (_unpickle_job, (self.sections(), self.features, self.world, self.prepared, given))


def _unpickle_job(
    sections: dict, features: FeatureSpec, world: World, prepared: PreparedData | None, given: bool = False
) -> Job:
    # Never raise here: a spawned rank unpickles its arguments before its code runs, where an
    # error is reported by the launcher as "rank N failed" without its message. What cannot be
    # rebuilt here (a user's module this process cannot import) raises on first use instead.
    try:
        fmt = data_format(sections["data"])
    except Exception as err:  # noqa: BLE001 - reported on first use, with the rank's own error
        fmt = Unavailable(_rebuild_error(err))
    try:
        spec = GIVEN_MODEL if given else get_model(sections["model"].name)
    except Exception as err:  # noqa: BLE001
        spec = Unavailable(_rebuild_error(err, f"model.name: {sections['model'].name!r} is not registered here"))
    return Job(**sections, fmt=fmt, features=features, model_spec=spec, world=world, prepared=prepared)


def _rebuild_error(err: Exception, text: str | None = None) -> str:
    return (
        f"{text if text and isinstance(err, KeyError) else err} (in process {os.getpid()}, which received the "
        "resolved job: a spawned rank imports the user's modules again, from PYTHONPATH and the launching "
        "process's sys.path at launch; register a format or model at the top level of an imported module, or put "
        "its folder on PYTHONPATH)"
    )


class Unavailable:
    """A part of a :class:`Job` that this process could not rebuild (a spawned rank that cannot
    import the user's module the job names): any use raises ``ValueError`` with the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy / pickle protocol look-ups
            raise AttributeError(name)
        raise ValueError(self.reason)

    def __repr__(self) -> str:
        return f"Unavailable({self.reason!r})"


def _sizes(d: DataConfig, fmt: RawFormat, prepared: PreparedData) -> list[int]:
    if d.categorical_mapping == "vocabulary":
        return list(prepared.num_embeddings)
    return configured_sizes(d, fmt)


def _model(model: ModelConfig) -> ModelSpec | None:
    try:
        return get_model(model.name)
    except (ValueError, ImportError):
        return None


def prepare_data(job: Job, progress: bool = False) -> PreparedData:
    """Convert the job's raw data (cached); the ``PreparedData``.

    Raises:
        DataError: bad input, or an empty training split.
    """
    prepared = prepare_from_config(job.data, progress=progress, fmt=job.fmt)
    if prepared.rows["train"] == 0:
        rows = ", ".join(f"{k} {v}" for k, v in prepared.rows.items())
        raise DataError(
            f"{describe_raw_path(job.data.raw_path)}: the training split is empty ({rows} rows); give more rows or "
            "change data.split"
        )
    return prepared


def build_job(
    sections: dict[str, Section],
    prepared: PreparedData | None = None,
    world_size: int | None = None,
    given_model: bool = False,
    sizes: list[int] | None = None,
) -> Job:
    """The :class:`Job` of validated sections (``{name: section}``, every name of
    :data:`SECTIONS`): its format object, FeatureSpec (tables on ``meta``; sized as ``sizes``
    gives, else as ``prepared`` decided when the data is converted, else as configured),
    registered model (``given_model``: ``GIVEN_MODEL``, the model given to ``Trainer(model=...)``)
    and world size (``world_size``: torchrun's, else ``distributed.nproc_per_node``)."""
    d = sections["data"]
    fmt = data_format(d)
    spec = GIVEN_MODEL if given_model else _model(sections["model"])
    if sizes is None and prepared is not None:
        sizes = _sizes(d, fmt, prepared)
    hook = spec.on_features if spec is not None else None
    features = feature_spec(
        fmt, d, sections["model"], sizes, torch.device("cpu"), torch.device("meta"), on_features=hook
    )
    n = sections["distributed"].nproc_per_node
    world = World(nproc=n, size=world_size if world_size is not None else n)
    return Job(**sections, fmt=fmt, features=features, model_spec=spec, world=world, prepared=prepared)


def load_job(tree: dict, source: str, sizes: list[int] | None = None) -> Job:
    """The Job of a config tree a run wrote (``config.yaml``, a checkpoint's ``meta.json``
    ``config``), validated section by section; tables of ``sizes`` rows (e.g. the preprocessing
    record's), else as configured.

    Raises:
        ConfigError: naming ``source`` and every problem.
    """
    if not isinstance(tree, dict) or "data" not in tree:
        raise ConfigError(f"invalid config {source}: no data section")
    sections: dict[str, Section] = {}
    errors = []
    for name, cls in SECTIONS.items():
        value = tree.get(name, {})
        try:
            if name == "model":
                cls = model_config_class(value.get("name", "dlrm") if isinstance(value, dict) else value)
            sections[name] = cls.model_validate(value, context={IMPORT_USER_CODE: True})
            if name == "data":
                check_data(sections[name])
        except ValidationError as err:
            errors.append(format_validation_errors(err, source, prefix=name))
        except ValueError as err:
            errors.append(f"invalid config {source}:\n  {name}: {err}")
    unknown = sorted(set(tree) - set(SECTIONS))
    if unknown:
        errors.append(f"invalid config {source}:\n  {', '.join(unknown)}: unknown sections")
    if errors:
        raise ConfigError("\n".join(errors))
    return build_job(sections, sizes=sizes)
