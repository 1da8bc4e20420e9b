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
- ``shard``       ``recsys_dist.shard(model, sharding_config)``: bring your own model
"""

from recsys_dist._versions import check_versions

check_versions()

__version__ = "0.1.0"


def __getattr__(name):
    # torch and torchrec load only when the sharding API is used, not on `import recsys_dist`.
    if name == "shard":
        from recsys_dist.sharding import shard

        return shard
    raise AttributeError(f"module 'recsys_dist' has no attribute {name!r}")
