"""recsys_dist: embedding-parallel training of recommendation and CTR models on TorchRec.

The public API (``recsys_dist.<name>``; docs/api.md), loaded lazily so that
``import recsys_dist`` stays cheap:

- config: :func:`load_config`, :class:`RunConfig`, :class:`ConfigError`
- training: :class:`Trainer` (``fit``, ``evaluate``, ``predict``, ``save_checkpoint``,
  ``close``), :class:`Callback` (the Trainer's step / validation hooks), :func:`launch` (start N ranks from a script or notebook),
  :class:`FitSummary` / :class:`StreamSummary` (what ``fit()`` returns, as type checkers see it)
- the resolved run: :func:`resolve_job` (a ``RunConfig`` -> :class:`Job`: its sections, format
  object, :class:`FeatureSpec`, registered model and world, resolved once)
- models: :class:`FeatureSpec`, :func:`register_model`, :func:`register_loss`,
  :func:`build_model` (``build_model(job.model, job.features, job.train)``), :func:`feature_spec`
- sharding: :func:`shard` (plan and wrap your own model in DistributedModelParallel)
- data: :func:`prepare` (raw files -> cached Parquet splits), :class:`ParquetBatchLoader`,
  :class:`CTRBatch`
- metrics: :func:`binary_metrics`, :class:`StreamingBinaryMetrics`, :func:`gather_predictions`
- checkpoints: :func:`save_checkpoint`, :func:`load_checkpoint` (your own loop's model and
  optimizers, ``recsys_dist.checkpoint.loop``), :func:`latest_checkpoint`, :func:`load_model`
  (an unsharded model from a run, checkpoint or export)

Package map, lowest layer first (docs/architecture.md; tests/unit/api/test_layers.py enforces it):
``errors`` (every error type), ``section`` (the strict config-section base), ``faults`` (fault injection for the tests), ``logs``, ``versions``
(the torch / fbgemm-gpu / torchrec lock-step check), ``files`` (writes that never follow a
planted link); ``data/`` (formats, conversion, loader, FeatureSpec), ``models/`` (registry, zoo,
losses, task), ``distributed/`` (process group, planning, sharding, the bytes ledger),
``checkpoint/`` (checkpoints, the run directory), ``train/`` (the resolved Job, preflight, the
Trainer, evaluation, metrics, launch), ``serve/`` (export, TorchScript, scoring, HTTP,
publishing), ``config/`` (RunConfig, its loader, and its resolution into a Job: above every
component, so none takes the root config), ``cli/`` (the ``recsys-dist`` command), ``api`` (the
public Trainer, StreamTrainer, resolve_job over a RunConfig), ``testing`` (``run_ranks`` for
users' tests). Each package's docstring maps its modules.
"""

from recsys_dist.versions import __version__, check_versions

check_versions()

# public name -> module that defines it. Type checkers read __init__.pyi instead of this file
# (mypy and pyright do not look through a module-level __getattr__); tests/unit/api/test_typing.py
# keeps its names equal to these.
_API = {
    "load_config": "recsys_dist.config.loader",
    "RunConfig": "recsys_dist.config.run",
    "ConfigError": "recsys_dist.section",
    "Trainer": "recsys_dist.api",
    "Callback": "recsys_dist.train.trainer",
    "StreamTrainer": "recsys_dist.api",
    "resolve_job": "recsys_dist.api",
    "Job": "recsys_dist.train.job",
    "FitSummary": "recsys_dist.train.results",
    "StreamSummary": "recsys_dist.train.results",
    "FeatureSpec": "recsys_dist.data.spec",
    "register_model": "recsys_dist.models.registry",
    "register_loss": "recsys_dist.models.losses",
    "register_format": "recsys_dist.data.formats.base",
    "build_model": "recsys_dist.models.build",
    "feature_spec": "recsys_dist.api",
    "shard": "recsys_dist.distributed.sharding",
    "prepare": "recsys_dist.api",
    "ParquetBatchLoader": "recsys_dist.data.loader",
    "CTRBatch": "recsys_dist.data.loader",
    "binary_metrics": "recsys_dist.train.metrics",
    "StreamingBinaryMetrics": "recsys_dist.train.metrics",
    "gather_predictions": "recsys_dist.train.metrics",
    "save_checkpoint": "recsys_dist.checkpoint.loop",
    "load_checkpoint": "recsys_dist.checkpoint.loop",
    "latest_checkpoint": "recsys_dist.checkpoint.meta",
    "load_model": "recsys_dist.serve.export",
    "launch": "recsys_dist.train.launch",
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> object:
    if name in _API:
        import importlib

        module = importlib.import_module(_API[name])
        return getattr(module, name)
    raise AttributeError(f"module 'recsys_dist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
