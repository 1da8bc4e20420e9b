"""The public entry points that take a ``RunConfig``: each resolves it into a
:class:`~recsys_dist.train.job.Job` once (``recsys_dist.config.job.resolve_job``) and hands the Job
down; nothing below takes the root config.

``recsys_dist.Trainer``, ``recsys_dist.StreamTrainer``, ``recsys_dist.resolve_job``,
``recsys_dist.feature_spec`` and ``recsys_dist.prepare`` are these.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import nn

from recsys_dist.config.job import resolve_job
from recsys_dist.config.run import RunConfig
from recsys_dist.data.convert import PreparedData
from recsys_dist.data.resolve import prepare_from_config
from recsys_dist.data.spec import FeatureSpec
from recsys_dist.train import stream as _stream
from recsys_dist.train import trainer as _trainer
from recsys_dist.train.build import DenseOptimizerFactory, LRSchedulerFactory, ModelFactory
from recsys_dist.train.job import Job
from recsys_dist.train.preflight import check_sections

__all__ = ["StreamTrainer", "Trainer", "feature_spec", "prepare", "resolve_job"]


def _checked_job(cfg: RunConfig | Job, given_model: bool) -> Job:
    """A Job to train: ``cfg`` resolved and its cross-section rules checked (a Job is taken as
    it is: whoever resolved it checked it, as ``recsys-dist train`` does)."""
    if isinstance(cfg, Job):
        return cfg
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"expected a RunConfig (recsys_dist.load_config) or a Job, got {type(cfg).__name__}")
    job = resolve_job(cfg, given_model=given_model)
    check_sections(job)  # the checks of the model trained: model.name's, or none for model=
    return job


class Trainer(_trainer.Trainer):
    __doc__ = _trainer.Trainer.__doc__

    def __init__(
        self,
        cfg: RunConfig | Job,
        run_dir: str | Path,
        *,
        resume: str | Path | None = None,
        profile_dir: str | Path | None = None,
        model: nn.Module | ModelFactory | None = None,
        dense_optimizer: DenseOptimizerFactory | None = None,
        lr_scheduler: LRSchedulerFactory | None = None,
        callbacks: Sequence[_trainer.Callback] = (),
        resume_on_new_data: bool = False,
    ) -> None:
        self.cfg = cfg
        super().__init__(
            _checked_job(cfg, model is not None),
            run_dir,
            resume=resume,
            profile_dir=profile_dir,
            model=model,
            dense_optimizer=dense_optimizer,
            lr_scheduler=lr_scheduler,
            callbacks=callbacks,
            resume_on_new_data=resume_on_new_data,
        )


class StreamTrainer(Trainer, _stream.StreamTrainer):
    # The public Trainer's constructor (a RunConfig resolved once) over the stream trainer's data
    # source and fit: the MRO runs Trainer.__init__, then the library StreamTrainer's parts.
    __doc__ = _stream.StreamTrainer.__doc__


def feature_spec(cfg: RunConfig, num_embeddings: list[int] | None = None) -> FeatureSpec:
    """The :class:`FeatureSpec` of a config: ``resolve_job(cfg, sizes=num_embeddings).features``
    (tables on ``meta``; ``num_embeddings``: rows per categorical feature, in the format's order,
    e.g. ``prepare(cfg).num_embeddings``; default: as configured)."""
    return resolve_job(cfg, sizes=num_embeddings).features


def prepare(cfg: RunConfig, progress: bool = False) -> PreparedData:
    """Convert (or reuse from the cache) the config's raw data into Parquet splits:
    ``recsys_dist.data.resolve.prepare_from_config(cfg.data)``."""
    return prepare_from_config(cfg.data, progress=progress)
