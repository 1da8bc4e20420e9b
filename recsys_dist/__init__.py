"""recsys_dist: embedding-parallel training of recommendation and CTR models on TorchRec.

Map of the package:

- ``config``      the typed run config (YAML + dotted overrides), validated up front
- ``data``        Criteo TSV -> Parquet conversion; Parquet -> rank-sharded KJT batches
- ``models``      models over EmbeddingBagCollection and the CTR task wrapper
- ``sharding``    sharders (every sharding type, CPU included), planner, plan summaries
- ``distributed`` the one place the process group is created
- ``trainer``     the pipelined training loop (TrainPipelineSparseDist) and evaluation
- ``metrics``     exact global AUC / logloss / NE over all ranks
- ``checkpoint``  sharded, atomic torch.distributed.checkpoint saves
- ``cli``         the ``recsys-dist`` command
"""

from recsys_dist._versions import check_versions

check_versions()

__version__ = "0.1.0"
