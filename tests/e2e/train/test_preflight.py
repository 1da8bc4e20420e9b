"""Config refusals found by an adversarial review, each before any rank starts (exit 2 from the
CLI, in-process): an embedding module no sharder covers, a sharding type no sequence table can
take, vocabulary and eviction options that the chosen mapping / policy would silently ignore."""

import pytest

from recsys_dist.cli import main as cli
from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.preflight import check_before_launch
from tests.conftest import QUICKSTART
from tests.unit.train.test_preflight import DIN


def test_uncovered_embedding_module_is_refused_before_any_rank(tmp_path, capsys):
    name = "tests.unit.train.test_preflight:PlainEmbeddingTower"  # defined beside the unit tests
    args = ["train", "--config", str(QUICKSTART), "--run-dir", str(tmp_path / "run"), "model={name: " + name + "}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"model.name: {name}: extra.0 is a torch.nn.modules.sparse.Embedding, which no sharder covers" in err
    assert "EmbeddingBagCollection" in err and "EmbeddingCollection" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    # recsys-dist plan says the same (exit 2, not a planner failure)
    assert cli.main(["plan", "--config", str(QUICKSTART), "--world-size", "2", "model={name: " + name + "}"]) == 2
    assert "extra.0 is a torch.nn.modules.sparse.Embedding" in capsys.readouterr().err


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


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    """train.batch_size=16777216 started the ranks, which the out-of-memory killer ended
    ("Signal 9"); now the batch's tensors are estimated against the memory available first."""
    from recsys_dist.train import batch_memory

    huge = resolve_job(load_config(QUICKSTART, ["train.batch_size=16777216", "distributed.device=cpu"]))
    # 26 features x 16 dims, MLPs [64, 16] and [64, 32, 1]: inputs 372 bytes, then
    # 4 x (16 x 26 + 177) = 2,372 bytes of embeddings and activations, twice with gradients.
    assert batch_memory.bytes_per_example(huge, training=True) == 372 + 2 * 2372
    assert batch_memory.bytes_per_example(huge, training=False) == 372 + 2372
    gib = 1 << 30
    (problem,) = batch_memory.batch_memory_problems(huge, 2, (100 * gib, "MemAvailable"))
    assert problem.startswith("train.batch_size: 16,777,216 examples per rank need at least 159.9 GiB")
    assert "100.0 GiB available (MemAvailable)" in problem
    assert batch_memory.batch_memory_problems(huge, 2, (200 * gib, "MemAvailable")) == []
    ev = resolve_job(load_config(QUICKSTART, ["eval.batch_size=16777216", "distributed.device=cpu"]))
    (problem,) = batch_memory.batch_memory_problems(ev, 2, (10 * gib, "MemAvailable"))
    assert problem.startswith("eval.batch_size: 16,777,216") and "85.8 GiB" in problem
    assert batch_memory.batch_memory_problems(resolve_job(load_config(QUICKSTART)), 2, (gib, "MemAvailable")) == []
    real = batch_memory.available_memory()
    assert real is None or real[0] >= 0
    # Before launch, and from the command line: exit 2 naming the key.
    monkeypatch.setattr(batch_memory, "available_memory", lambda: (100 * gib, "MemAvailable in /proc/meminfo"))
    with pytest.raises(ConfigError, match=r"train.batch_size: 16,777,216 examples per rank need at least 159.9 GiB"):
        check_before_launch(huge)
    argv = ["train", "--config", str(QUICKSTART), "--run-dir", str(tmp_path / "run"), "train.batch_size=16777216"]
    assert cli.main([*argv, "distributed.device=cpu"]) == 2
    assert "train.batch_size: 16,777,216 examples per rank need at least" in capsys.readouterr().err
