"""recsys_dist: embedding-parallel training of recommendation and CTR models on TorchRec.

The public API (``recsys_dist.<name>``; docs/api.md), loaded lazily so that
``import recsys_dist`` stays cheap:

- config: :func:`load_config`, :class:`RunConfig`, :class:`ConfigError`
- training: :class:`Trainer` (``fit``, ``evaluate``, ``predict``, ``save_checkpoint``,
  ``close``), :class:`Callback` (the Trainer's step / validation hooks), :func:`launch` (start N ranks from a script or notebook)
- models: :class:`FeatureSpec`, :func:`register_model`, :func:`register_loss`,
  :func:`build_model`, :func:`feature_spec`
- sharding: :func:`shard` (plan and wrap your own model in DistributedModelParallel)
- data: :func:`prepare` (raw files -> cached Parquet splits), :class:`ParquetBatchLoader`,
  :class:`CTRBatch`
- metrics: :func:`binary_metrics`, :class:`StreamingBinaryMetrics`, :func:`gather_predictions`
- checkpoints: :func:`save_checkpoint`, :func:`load_checkpoint` (your own loop's model and
  optimizers, ``recsys_dist.loop_checkpoint``), :func:`latest_checkpoint`, :func:`load_model`
  (an unsharded model from a run, checkpoint or export)

Package map: ``config/`` (loader, RunConfig), ``data/`` (formats, conversion, loader),
``models/`` (registry, zoo, losses, task), ``spec`` (FeatureSpec), ``sharding`` / ``planning``
(sharders, planner, dry run), ``distributed`` / ``launch`` (process group, elastic launch),
``trainer`` (the training loop), ``evaluation`` (global metrics, row-ordered predictions),
``metrics_writer`` (metrics.jsonl), ``run_dir`` (the run directory's rules, CLI and Trainer),
``metrics``, ``checkpoint``, ``export``, ``report``, ``cli``.
"""

from typing import TYPE_CHECKING

from recsys_dist.versions import check_versions

check_versions()

__version__ = "0.1.0"

# public name -> module that defines it
_API = {
    "load_config": "recsys_dist.config",
    "RunConfig": "recsys_dist.config",
    "ConfigError": "recsys_dist.config",
    "Trainer": "recsys_dist.trainer",
    "Callback": "recsys_dist.callbacks",
    "FeatureSpec": "recsys_dist.spec",
    "register_model": "recsys_dist.models",
    "register_loss": "recsys_dist.models",
    "build_model": "recsys_dist.models",
    "feature_spec": "recsys_dist.models",
    "shard": "recsys_dist.sharding",
    "prepare": "recsys_dist.data",
    "ParquetBatchLoader": "recsys_dist.data.loader",
    "CTRBatch": "recsys_dist.data.loader",
    "binary_metrics": "recsys_dist.metrics",
    "StreamingBinaryMetrics": "recsys_dist.metrics",
    "gather_predictions": "recsys_dist.metrics",
    "save_checkpoint": "recsys_dist.loop_checkpoint",
    "load_checkpoint": "recsys_dist.loop_checkpoint",
    "latest_checkpoint": "recsys_dist.checkpoint",
    "load_model": "recsys_dist.export",
}

__all__ = sorted([*_API, "launch"]) + ["__version__"]

# Bound now, not looked up lazily: importing the submodule ``recsys_dist.launch`` (the CLI does)
# sets the package attribute of that name to the module, and the function must win. The module
# is light; torch loads when ``launch`` is called.
from recsys_dist.launch import launch  # noqa: E402, F401

if TYPE_CHECKING:
    # What type checkers see: the names of _API with their real types (mypy and pyright do not
    # look through a module-level __getattr__). At run time they load lazily, below;
    # tests/api/test_typing.py keeps the two lists equal. ("X as X": an explicit re-export.)
    from recsys_dist.callbacks import Callback as Callback
    from recsys_dist.checkpoint import latest_checkpoint as latest_checkpoint
    from recsys_dist.config.base import ConfigError as ConfigError
    from recsys_dist.config.loader import load_config as load_config
    from recsys_dist.config.run import RunConfig as RunConfig
    from recsys_dist.data import prepare_from_config as _prepare_from_config
    from recsys_dist.data.loader import CTRBatch as CTRBatch
    from recsys_dist.data.loader import ParquetBatchLoader as ParquetBatchLoader
    from recsys_dist.export import load_model as load_model
    from recsys_dist.loop_checkpoint import load_checkpoint as load_checkpoint
    from recsys_dist.loop_checkpoint import save_checkpoint as save_checkpoint
    from recsys_dist.metrics import StreamingBinaryMetrics as StreamingBinaryMetrics
    from recsys_dist.metrics import binary_metrics as binary_metrics
    from recsys_dist.metrics import gather_predictions as gather_predictions
    from recsys_dist.models import build_model as build_model
    from recsys_dist.models import feature_spec as feature_spec
    from recsys_dist.models import register_loss as register_loss
    from recsys_dist.models import register_model as register_model
    from recsys_dist.sharding import shard as shard
    from recsys_dist.spec import FeatureSpec as FeatureSpec
    from recsys_dist.trainer import Trainer as Trainer

    prepare = _prepare_from_config


if not TYPE_CHECKING:  # hidden from type checkers, so that a name not in the API is an error there

    def __getattr__(name: str) -> object:
        if name in _API:
            import importlib

            module = importlib.import_module(_API[name])
            attr = "prepare_from_config" if name == "prepare" else name
            return getattr(module, attr)
        raise AttributeError(f"module 'recsys_dist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
