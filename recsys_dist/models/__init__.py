"""Models over TorchRec's EmbeddingBagCollection, their registry, losses, and the task wrapper.

``models.build.build_model(model_cfg, features, train_cfg)`` returns a :class:`models.task.CTRTask` around the model
``model.name`` names: a shipped one (``recsys_dist/models/zoo/``), one added with
``models.registry.register_model``, or a factory named by import path. Tables are named
``t_<feature>``, one per categorical feature; DeepFM, Wide & Deep and xDeepFM add a first-order
table ``w_<feature>`` each (their ``on_features`` hook), in the same collection. Build on
``torch.device("meta")`` before sharding: no table memory is allocated until
DistributedModelParallel materialises each rank's shards.

Modules: ``build`` (the configured model), ``registry`` (models by name or import path),
``config`` (the ``model:`` section), ``checks`` (the shipped models' config checks), ``layers``
(shared building blocks), ``losses``, ``task`` (the loss wrapper), ``managed`` and
``managed_ops`` (managed-collision tables), ``sequence`` (DIN and BST's sequence layer), ``tower`` (a model's dense tower cut into stages),
``retrieval`` (two-tower evaluation), ``next_item`` (leave-last-out split, exact ranks, HR/NDCG/MRR),
``hstu_retrieval`` (HSTU next-item retrieval over one sharded item table), ``sasrec_retrieval``
(the SASRec encoder in its place: the baseline), ``hstu_attention``
(HSTU's pointwise attention over padded tokens, dense or query-chunked), ``hstu_jagged`` (HSTU's
layers over packed tokens: no compute on padding), ``hstu_time`` (its relative time bias) and ``zoo/`` (the shipped models, one family per file).
Nothing is re-exported here: import from the defining module (``recsys_dist.models.build``, ...).
"""
