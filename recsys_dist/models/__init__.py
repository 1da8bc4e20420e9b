"""Models over TorchRec's EmbeddingBagCollection, their registry, losses, and the task wrapper.

``models.build.build_model(cfg, spec)`` returns a :class:`models.task.CTRTask` around the model
``model.name`` names: a shipped one (``recsys_dist/models/zoo/``), one added with
``models.registry.register_model``, or a factory named by import path. Tables are named
``t_<feature>``, one per categorical feature; DeepFM, Wide & Deep and xDeepFM add a first-order
table ``w_<feature>`` each (their ``on_features`` hook), in the same collection. Build on
``torch.device("meta")`` before sharding: no table memory is allocated until
DistributedModelParallel materialises each rank's shards.

Nothing is re-exported here: import from the defining module (``recsys_dist.models.build``, ...).
"""
