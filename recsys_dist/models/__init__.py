"""Models over TorchRec's EmbeddingBagCollection, their registry, losses, and the task wrapper.

``build_model(cfg, spec)`` returns a :class:`CTRTask` around the model ``model.name`` names:
a shipped one (``recsys_dist/models/zoo/``), one added with :func:`register_model`, or a
factory named by import path. Tables are named ``t_<feature>``, one per categorical feature;
DeepFM, Wide & Deep and xDeepFM add a first-order table ``w_<feature>`` each, in the same
collection. Build on ``torch.device("meta")`` before sharding: no table memory is allocated
until DistributedModelParallel materialises each rank's shards.
"""

from recsys_dist.models.build import build_model, embedding_configs, feature_spec
from recsys_dist.models.losses import get_loss, register_loss
from recsys_dist.models.registry import get_model, model_names, register_model
from recsys_dist.models.task import CTRTask

__all__ = [
    "CTRTask",
    "build_model",
    "embedding_configs",
    "feature_spec",
    "get_loss",
    "get_model",
    "model_names",
    "register_loss",
    "register_model",
]
