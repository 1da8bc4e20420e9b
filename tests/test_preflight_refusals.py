"""Config refusals found by an adversarial review, each before any rank starts (exit 2 from the
CLI, in-process): an embedding module no sharder covers, a sharding type no sequence table can
take, vocabulary and eviction options that the chosen mapping / policy would silently ignore."""

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection

from recsys_dist.cli import main as cli
from recsys_dist.cli import main as cli_main
from recsys_dist.cli import train_run as train_cmd
from recsys_dist.config import ConfigError
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


def test_uncovered_embedding_module_is_refused_before_any_rank(tmp_path, capsys):
    name = f"{__name__}:PlainEmbeddingTower"
    args = ["train", "--config", str(QUICKSTART), "--run-dir", str(tmp_path / "run"), "model={name: " + name + "}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"model.name: {name}: extra.0 is a torch.nn.modules.sparse.Embedding, which no sharder covers" in err
    assert "EmbeddingBagCollection" in err and "EmbeddingCollection" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    # recsys-dist plan says the same (exit 2, not a planner failure)
    assert cli.main(["plan", "--config", str(QUICKSTART), "--world-size", "2", "model={name: " + name + "}"]) == 2
    assert "extra.0 is a torch.nn.modules.sparse.Embedding" in capsys.readouterr().err


def test_shipped_models_pass_the_coverage_check():
    check_before_launch(load_config(QUICKSTART))
    check_before_launch(load_config(DIN))


@pytest.mark.parametrize(
    "override, key",
    [
        ("sharding.sharding_types=[table_row_wise]", "sharding.sharding_types: ['table_row_wise']"),
        (
            "sharding.per_table={s_history: {sharding_types: [table_column_wise]}}",
            "sharding.per_table.s_history.sharding_types: ['table_column_wise']",
        ),
    ],
)
def test_plan_refuses_a_type_no_sequence_table_takes(override, key, capsys):
    assert cli.main(["plan", "--config", str(DIN), "--world-size", "2", "--device", "cpu", override]) == 2
    err = capsys.readouterr().err
    assert key in err and "EmbeddingCollection (sequence) table s_history" in err
    assert "['data_parallel', 'table_wise', 'row_wise', 'column_wise']" in err and "Traceback" not in err


def test_fixed_plan_of_a_sequence_table_is_checked_before_launch():
    with pytest.raises(ConfigError, match=r"sharding\.fixed_plan\.s_history\.sharding_type: table_row_wise"):
        check_before_launch(
            load_config(DIN, ["sharding.fixed_plan={s_history: {sharding_type: table_row_wise, ranks: [0, 1]}}"])
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


def test_ranks_fork_on_cpu_spawn_on_cuda_and_fork_with_cuda_is_refused(monkeypatch):
    assert train_cmd.start_method(load_config(QUICKSTART, ["distributed.device=cpu"])) == "spawn"  # from Python
    monkeypatch.setattr(cli_main, "ENTRY_POINT", True)  # the recsys-dist command
    assert train_cmd.start_method(load_config(QUICKSTART, ["distributed.device=cpu"])) == "fork"
    assert train_cmd.start_method(load_config(QUICKSTART, ["distributed.device=cuda"])) == "spawn"
    assert train_cmd.start_method(load_config(QUICKSTART, ["distributed.start_method=spawn"])) == "spawn"
    with pytest.raises(ConfigError, match="distributed.start_method: fork cannot start CUDA ranks"):
        train_cmd.start_method(load_config(QUICKSTART, ["distributed.device=cuda", "distributed.start_method=fork"]))


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    """train.batch_size=16777216 started the ranks, which the out-of-memory killer ended
    ("Signal 9"); now the batch's tensors are estimated against the memory available first."""
    from recsys_dist.train import batch_memory

    huge = load_config(QUICKSTART, ["train.batch_size=16777216", "distributed.device=cpu"])
    # 26 features x 16 dims, MLPs [64, 16] and [64, 32, 1]: inputs 372 bytes, then
    # 4 x (16 x 26 + 177) = 2,372 bytes of embeddings and activations, twice with gradients.
    assert batch_memory.bytes_per_example(huge, training=True) == 372 + 2 * 2372
    assert batch_memory.bytes_per_example(huge, training=False) == 372 + 2372
    gib = 1 << 30
    (problem,) = batch_memory.batch_memory_problems(huge, 2, (100 * gib, "MemAvailable"))
    assert problem.startswith("train.batch_size: 16,777,216 examples per rank need at least 159.9 GiB")
    assert "100.0 GiB available (MemAvailable)" in problem
    assert batch_memory.batch_memory_problems(huge, 2, (200 * gib, "MemAvailable")) == []
    ev = load_config(QUICKSTART, ["eval.batch_size=16777216", "distributed.device=cpu"])
    (problem,) = batch_memory.batch_memory_problems(ev, 2, (10 * gib, "MemAvailable"))
    assert problem.startswith("eval.batch_size: 16,777,216") and "85.8 GiB" in problem
    assert batch_memory.batch_memory_problems(load_config(QUICKSTART), 2, (gib, "MemAvailable")) == []
    real = batch_memory.available_memory()
    assert real is None or real[0] >= 0
    # Before launch, and from the command line: exit 2 naming the key.
    monkeypatch.setattr(batch_memory, "available_memory", lambda: (100 * gib, "MemAvailable in /proc/meminfo"))
    with pytest.raises(ConfigError, match=r"train.batch_size: 16,777,216 examples per rank need at least 159.9 GiB"):
        check_before_launch(huge)
    argv = ["train", "--config", str(QUICKSTART), "--run-dir", str(tmp_path / "run"), "train.batch_size=16777216"]
    assert cli.main([*argv, "distributed.device=cpu"]) == 2
    assert "train.batch_size: 16,777,216 examples per rank need at least" in capsys.readouterr().err
