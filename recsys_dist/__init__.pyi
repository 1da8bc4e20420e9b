"""What type checkers see of ``recsys_dist`` (the lazy names of ``__init__.py`` with their real
types; the convention of scientific Python's SPEC 1, lazy_loader). ("X as X": an explicit re-export.)"""

from recsys_dist.train.launch import launch as launch

__version__: str
__all__: list[str]

from recsys_dist.api import StreamTrainer as StreamTrainer
from recsys_dist.api import Trainer as Trainer
from recsys_dist.api import feature_spec as feature_spec
from recsys_dist.api import prepare as prepare
from recsys_dist.api import resolve_job as resolve_job
from recsys_dist.checkpoint.loop import load_checkpoint as load_checkpoint
from recsys_dist.checkpoint.loop import save_checkpoint as save_checkpoint
from recsys_dist.checkpoint.meta import latest_checkpoint as latest_checkpoint
from recsys_dist.config.loader import load_config as load_config
from recsys_dist.config.run import RunConfig as RunConfig
from recsys_dist.data.formats.base import register_format as register_format
from recsys_dist.data.loader import CTRBatch as CTRBatch
from recsys_dist.data.loader import ParquetBatchLoader as ParquetBatchLoader
from recsys_dist.data.spec import FeatureSpec as FeatureSpec
from recsys_dist.distributed.sharding import shard as shard
from recsys_dist.models.build import build_model as build_model
from recsys_dist.models.losses import register_loss as register_loss
from recsys_dist.models.registry import register_model as register_model
from recsys_dist.section import ConfigError as ConfigError
from recsys_dist.serve.export import load_model as load_model
from recsys_dist.train.job import Job as Job
from recsys_dist.train.metrics import StreamingBinaryMetrics as StreamingBinaryMetrics
from recsys_dist.train.metrics import binary_metrics as binary_metrics
from recsys_dist.train.metrics import gather_predictions as gather_predictions
from recsys_dist.train.results import FitSummary as FitSummary
from recsys_dist.train.results import StreamSummary as StreamSummary
from recsys_dist.train.trainer import Callback as Callback
