"""``RunConfig``: the whole run, one section per component, validated together.

Each section belongs to the component that uses it; this module only composes them and
dispatches ``model:`` to the class of the chosen ``model.name``. Checks that need two
sections live in ``recsys_dist.train.preflight`` (the one module that sees every section),
which runs them once on the resolved run (``recsys_dist.train.job.Job``): the command line
before any rank starts, the Trainer for a config it is given.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator

from recsys_dist.checkpoint.config import CheckpointConfig
from recsys_dist.data.config import DataConfig
from recsys_dist.data.resolve import check_data
from recsys_dist.distributed.config import DistributedConfig, ShardingConfig
from recsys_dist.models.config import ModelConfig
from recsys_dist.models.registry import model_config_class
from recsys_dist.section import Section
from recsys_dist.train.config import EvalConfig, PublishConfig, TrainConfig


class RunConfig(Section):
    """A run: ``data``, ``model``, ``train``, ``distributed``, ``sharding``, ``checkpoint``, ``eval``,
    ``publish``.

    Build it with :func:`recsys_dist.load_config` (YAML plus dotted overrides) or
    :func:`recsys_dist.config.config_from_dict`; both raise ``ConfigError`` listing every
    problem of each section. Problems across sections (a loss for a task the data lacks, a
    model that needs dense features, ...) are reported by
    ``recsys_dist.train.preflight.check_sections``, which ``recsys-dist train`` and the
    Trainer run. ``model`` is an instance of the chosen model's own config class.
    """

    data: DataConfig
    model: SerializeAsAny[ModelConfig] = Field(default_factory=lambda: model_config_class("dlrm")())
    train: TrainConfig = Field(default_factory=TrainConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)

    @field_validator("data")
    @classmethod
    def _data_format(cls, value: DataConfig) -> DataConfig:
        # The checks that need the format's feature names live in the data layer (a section
        # config loads no format); errors raised here are located at ``data``, as DataConfig's own.
        check_data(value)
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _model_class(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, ModelConfig) or not isinstance(value, dict):
            return value
        return model_config_class(value.get("name", "dlrm")).model_validate(value, context=info.context)

    def to_dict(self) -> dict[str, Any]:
        """Every key with its resolved value, as plain JSON types (what config.yaml holds)."""
        return self.model_dump(mode="json")
