"""The resolved run: a :class:`Job` holds what every layer used to re-derive from the config.

The launcher builds it once (:func:`resolve_job`), preflight checks it once
(``recsys_dist.train.preflight.check_before_launch``), and the ranks it starts receive it
(pickled to a spawned rank, inherited by a forked one) instead of a config path to parse
again. The Trainer takes it, or builds it from a ``RunConfig`` for users of the Python API.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from recsys_dist.config.run import RunConfig
from recsys_dist.data.config import describe_raw_path
from recsys_dist.data.convert import PreparedData
from recsys_dist.data.formats.base import RawFormat
from recsys_dist.data.resolve import prepare_from_config, raw_format
from recsys_dist.data.spec import FeatureSpec
from recsys_dist.errors import DataError
from recsys_dist.models.build import feature_spec, table_sizes
from recsys_dist.models.registry import GIVEN_MODEL, ModelSpec, get_model


@dataclass(frozen=True)
class World:
    """The job's size: ``nproc`` ranks on this machine (``distributed.nproc_per_node``),
    ``size`` ranks in all (torchrun's ``WORLD_SIZE`` when known, else ``nproc``)."""

    nproc: int
    size: int


@dataclass(frozen=True)
class Job:
    """A run config resolved once.

    Attributes:
        cfg: the validated config.
        fmt: the data format object of ``data.format`` (``recsys_dist.data.resolve.raw_format``).
        features: the run's FeatureSpec, tables on ``meta``: dense / sparse / sequence names,
            tasks, and the table sizes (as configured until the data is converted, then the
            sizes the conversion decided: :meth:`with_data`).
        model: the registered model ``model.name`` names (None for an import-path model that
            cannot be loaded here: validation reports it), or ``GIVEN_MODEL`` for the model given
            to ``Trainer(model=...)`` (no checks, no hooks).
        world: the job's size.
        prepared: the converted data (``PreparedData``), once converted; None before.
    """

    cfg: RunConfig
    fmt: RawFormat
    features: FeatureSpec
    model: ModelSpec | None
    world: World
    prepared: PreparedData | None = None

    @property
    def table_sizes(self) -> list[int]:
        """Rows of every feature's table (sequence features last), as the loaders bound ids."""
        return [t.num_embeddings for t in self.features.tables + self.features.sequence_tables]

    @property
    def tasks(self) -> tuple[list[str], list[str]]:
        """(task names, kinds ``binary`` / ``regression``), in label-column order."""
        return list(self.features.tasks), list(self.fmt.task_kinds)

    @property
    def label_columns(self) -> tuple[list[str], str | None]:
        """(label columns, sample-weight column or None) of the converted Parquet."""
        return list(self.fmt.label_columns), self.fmt.weight_column

    def with_data(self, prepared: PreparedData) -> Job:
        """This job over converted data: its table sizes are the ones the conversion decided
        (under vocabulary mapping the vocabularies' sizes, else the configured ones)."""
        sizes = _sizes(self.cfg, prepared)
        features = self.features
        if sizes != self.table_sizes:
            given = self.model is GIVEN_MODEL
            features = feature_spec(self.cfg, sizes, torch.device("cpu"), torch.device("meta"), given_model=given)
        return dataclasses.replace(self, features=features, prepared=prepared)

    def given_model(self) -> Job:
        """This job training the model given to ``Trainer(model=...)`` instead of ``model.name``'s."""
        return dataclasses.replace(self, model=GIVEN_MODEL)

    def __reduce__(self):
        # A spawned rank gets the config, features, world and data; the format object and the
        # model's registry entry (which may hold closures) are looked up again there.
        given = self.model is GIVEN_MODEL
        return (_unpickle_job, (self.cfg, self.features, self.world, self.prepared, given))


def _unpickle_job(
    cfg: RunConfig, features: FeatureSpec, world: World, prepared: PreparedData | None, given: bool = False
) -> Job:
    return Job(cfg, _format(cfg), features, GIVEN_MODEL if given else _model(cfg), world, prepared)


def _sizes(cfg: RunConfig, prepared: PreparedData) -> list[int]:
    if cfg.data.categorical_mapping == "vocabulary":
        return list(prepared.num_embeddings)
    return table_sizes(cfg)


def _format(cfg: RunConfig) -> RawFormat:
    d = cfg.data
    return raw_format(d.format, d.schema, getattr(d, "short_lines", "error"))


def _model(cfg: RunConfig) -> ModelSpec | None:
    try:
        return get_model(cfg.model.name)
    except (ValueError, ImportError):
        return None


def prepare_data(cfg: RunConfig, progress: bool = False) -> PreparedData:
    """Convert the raw data (cached); the ``PreparedData``.

    Raises:
        DataError: bad input, or an empty training split.
    """
    prepared = prepare_from_config(cfg, progress=progress)
    if prepared.rows["train"] == 0:
        rows = ", ".join(f"{k} {v}" for k, v in prepared.rows.items())
        raise DataError(
            f"{describe_raw_path(cfg.data.raw_path)}: the training split is empty ({rows} rows); give more rows or "
            "change data.split"
        )
    return prepared


def resolve_job(
    cfg: RunConfig, prepared: PreparedData | None = None, world_size: int | None = None, given_model: bool = False
) -> Job:
    """The :class:`Job` of a validated config: its format object, FeatureSpec (tables on
    ``meta``, sized as ``prepared`` decided when the data is converted, else as configured),
    registered model (``given_model``: ``GIVEN_MODEL``, the model given to
    ``Trainer(model=...)``) and world size (``world_size``: torchrun's, else
    ``distributed.nproc_per_node``)."""
    n = cfg.distributed.nproc_per_node
    sizes = _sizes(cfg, prepared) if prepared is not None else None
    features = feature_spec(cfg, sizes, torch.device("cpu"), torch.device("meta"), given_model=given_model)
    world = World(nproc=n, size=world_size if world_size is not None else n)
    model = GIVEN_MODEL if given_model else _model(cfg)
    return Job(cfg, _format(cfg), features, model, world, prepared)
