"""``train.embedding_weight_decay`` changes training, and as specified: the tables after 3
steps equal a plain reference that decays the rows of each batch (L2 added to the gradient
for row-wise Adagrad, decoupled for Adam), at world sizes 1 and 2 (one spawn each).

On CPU only data-parallel tables can decay (FBGEMM's CPU fused kernel ignores weight decay in
every weight_decay_mode), so sharded tables with a decay are refused there; the CUDA kernels
are checked in test_sharding_equivalence_gpu.py.
"""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.preflight import check_before_launch
from tests.conftest import QUICKSTART


def test_weight_decay_refusals():
    with pytest.raises(ConfigError, match="train.embedding_weight_decay: 0.01 is not applied by .* exact_sgd"):
        load_config(QUICKSTART, ["train.embedding_optimizer=exact_sgd", "train.embedding_weight_decay=0.01"])
    with pytest.raises(ConfigError, match="exact_adagrad"):
        load_config(QUICKSTART, ["train.embedding_optimizer=exact_adagrad", "train.embedding_weight_decay=0.01"])
    cfg = load_config(QUICKSTART, ["train.embedding_weight_decay=0.01", "distributed.device=cpu"])
    with pytest.raises(ConfigError, match="train.embedding_weight_decay: 0.01 would be ignored"):
        check_before_launch(resolve_job(cfg), memory=False)
    dp = ["train.embedding_weight_decay=0.01", "distributed.device=cpu", "sharding.sharding_types=[data_parallel]"]
    check_before_launch(resolve_job(load_config(QUICKSTART, dp)), memory=False)
