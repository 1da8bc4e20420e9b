"""The Python route of online training: StreamTrainer with the publishing callback, one rank in
this process; a Trainer asked to publish without the callback refuses."""

from __future__ import annotations

import json

import pytest

import recsys_dist
from recsys_dist.errors import CheckpointError
from recsys_dist.section import ConfigError
from recsys_dist.serve.publish import latest_version, load_published
from recsys_dist.serve.publishing import PublishCallback
from tests.conftest import QUICKSTART
from tests.unit.train.test_stream import CONFIG, NAMES, ROWS, land, overrides


class Partitions(recsys_dist.Callback):
    def __init__(self):
        self.seen = []

    def on_partition_end(self, trainer, partition, checkpoint):
        self.seen.append((partition, trainer.step, checkpoint.name if checkpoint else None))


def test_stream_trainer_with_the_publish_callback(tmp_path, monkeypatch):
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(tmp_path / "cache"))
    landing, run = tmp_path / "landing", tmp_path / "run"
    for name in NAMES[:2]:
        land(landing, name)
    cfg = recsys_dist.load_config(CONFIG, [*overrides(landing), "distributed.nproc_per_node=1", "train.batch_size=64"])
    with pytest.raises(ConfigError, match="publish.enabled: the Trainer publishes through its callback"):
        recsys_dist.StreamTrainer(cfg, run)
    seen = Partitions()
    with recsys_dist.StreamTrainer(cfg, run, callbacks=[seen, PublishCallback(cfg.publish, run)]) as trainer:
        summary = trainer.fit()
    assert summary["partitions"] == NAMES[:2] and summary["rows_trained"] == 2 * ROWS
    assert seen.seen == [(NAMES[0], 10, "step_00000010"), (NAMES[1], 20, "step_00000020")]
    assert latest_version(run / "publish") == 2
    model, version = load_published(run / "publish")
    assert version == 2 and model.job.data.stream is not None
    assert json.loads((run / "summary.json").read_text())["stopped"] == "idle"
    # A batch Trainer given the stream's checkpoint refuses it (it would lose the stream position).
    batch = recsys_dist.load_config(QUICKSTART, ["data.num_rows=500", "distributed.nproc_per_node=1"])
    with pytest.raises(CheckpointError, match="written by a run over data.stream"):
        recsys_dist.Trainer(batch, tmp_path / "batch", resume=run / "checkpoints" / "step_00000020")
    # The batch Trainer is not the stream's: it says which class to use.
    with pytest.raises(ConfigError, match="recsys_dist.StreamTrainer"):
        recsys_dist.Trainer(cfg, tmp_path / "other", callbacks=[PublishCallback(cfg.publish, tmp_path / "other")])
