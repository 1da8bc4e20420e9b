"""The bytes ledger of a dry-run plan, and the config checks of sharding.comms and train.pipeline
(no processes; the counted-vs-predicted check is tests/ranks/distributed/test_ledger.py)."""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.dry_run import dry_run
from tests.conftest import QUICKSTART


def test_plan_refuses_what_the_device_cannot_run(capsys):
    """bf16 comms and semi_sync on CPU: a config error, as recsys-dist train gives (bf16 crashed
    inside the sharders' codec registry). The dry run checks comms itself; the pipeline is the
    train layer's rule, which ``recsys-dist plan`` passes in."""
    from recsys_dist.cli import main as cli
    from recsys_dist.train.pipelines import pipeline_problems

    overrides = ["sharding.comms.forward=bf16", "train.pipeline=semi_sync"]
    job = resolve_job(load_config(QUICKSTART, overrides))
    with pytest.raises(ConfigError) as err:
        dry_run(job, 2, 2, "cpu", pipeline_problems(job.train.pipeline, "cpu"))
    assert "sharding.comms.forward: bf16 comms need CUDA" in str(err.value)
    assert "train.pipeline: semi_sync needs CUDA" in str(err.value)
    with pytest.raises(ConfigError, match="sharding.comms.forward: bf16 comms need CUDA"):
        dry_run(job, 2, 2, "cpu")
    assert cli.main(["plan", "--config", str(QUICKSTART), "--world-size", "2", "--device", "cpu", *overrides]) == 2
    out = capsys.readouterr().err
    assert "sharding.comms.forward: bf16 comms need CUDA" in out and "train.pipeline: semi_sync needs CUDA" in out
    assert dry_run(job, 2, 2, "cuda").ledger is not None  # on CUDA both run
