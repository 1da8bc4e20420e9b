"""Config refusals found by an adversarial review, each before any rank starts (exit 2 from the
CLI, in-process): an embedding module no sharder covers, a sharding type no sequence table can
take, vocabulary and eviction options that the chosen mapping / policy would silently ignore."""

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection

from recsys_dist.cli import train_run as train_cmd
from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.preflight import check_before_launch
from tests.conftest import QUICKSTART, ROOT

DIN = ROOT / "configs" / "movielens_din.yaml"
MANAGED = ["data.categorical_mapping=managed", "data.managed={eviction_interval: 1}"]


class PlainEmbeddingTower(nn.Module):
    """A custom model (named by import path) with a plain nn.Embedding beside its
    EmbeddingBagCollection: DMP would replicate that table on every rank."""

    def __init__(self, spec) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=spec.tables, device=spec.embedding_device)
        self.extra = nn.Sequential(nn.Embedding(100, spec.embedding_dim, device=spec.device))
        self.top = nn.Linear(spec.embedding_dim, 1, device=spec.device)

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        return self.top(self.extra[0].weight[: dense.shape[0]]).squeeze(-1)


def test_shipped_models_pass_the_coverage_check():
    check_before_launch(resolve_job(load_config(QUICKSTART)))
    check_before_launch(resolve_job(load_config(DIN)))


def test_fixed_plan_of_a_sequence_table_is_checked_before_launch():
    with pytest.raises(ConfigError, match=r"sharding\.fixed_plan\.s_history\.sharding_type: table_row_wise"):
        check_before_launch(
            resolve_job(
                load_config(DIN, ["sharding.fixed_plan={s_history: {sharding_type: table_row_wise, ranks: [0, 1]}}"])
            )
        )


@pytest.mark.parametrize("mapping", [[], MANAGED], ids=["hash", "managed"])
def test_min_count_without_a_vocabulary_is_refused(mapping):
    with pytest.raises(ConfigError, match=r"data\.min_count: 5 is only used with categorical_mapping: vocabulary"):
        load_config(QUICKSTART, [*mapping, "data.min_count=5"])
    load_config(QUICKSTART, ["data.categorical_mapping=vocabulary", "data.min_count=5"])


def test_decay_exponent_with_lfu_is_refused():
    managed = "data.managed={eviction_interval: 1, eviction: %s, decay_exponent: 2.0}"
    with pytest.raises(ConfigError, match=r"data\.managed\.decay_exponent: 2\.0 is only used by eviction lru"):
        load_config(QUICKSTART, ["data.categorical_mapping=managed", managed % "lfu"])
    for policy in ("lru", "distance_lfu"):
        load_config(QUICKSTART, ["data.categorical_mapping=managed", managed % policy])


def test_ranks_start_from_a_forkserver_on_cpu_spawn_on_cuda_and_fork_with_cuda_is_refused():
    def method(*overrides):  # start_method takes the distributed section
        return train_cmd.start_method(load_config(QUICKSTART, list(overrides)).distributed)

    # never a fork of the launcher by default: its threads may hold a lock at the fork
    assert method("distributed.device=cpu") == "forkserver"
    assert method("distributed.device=cuda") == "spawn"
    assert method("distributed.start_method=spawn") == "spawn"
    assert method("distributed.start_method=fork") == "fork"
    with pytest.raises(ConfigError, match="distributed.start_method: fork cannot start CUDA ranks"):
        method("distributed.device=cuda", "distributed.start_method=fork")
