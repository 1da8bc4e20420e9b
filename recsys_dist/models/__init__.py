"""Models over TorchRec's EmbeddingBagCollection, and the task wrapper that adds the loss.

``build_model(cfg, device)`` returns a :class:`CTRTask` whose tables are named
``t_<feature>`` (``t_C1`` .. ``t_C26`` for Criteo), one table per categorical feature; DeepFM,
Wide & Deep and xDeepFM add a first-order table ``w_<feature>`` each, in the same collection.
Build on ``torch.device("meta")`` before sharding: no table memory is allocated until
DistributedModelParallel materialises each rank's shards.
"""

from recsys_dist.models.build import build_model, embedding_configs
from recsys_dist.models.task import CTRTask

__all__ = ["CTRTask", "build_model", "embedding_configs"]
