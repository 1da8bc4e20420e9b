"""The Python route of online training: StreamTrainer with the publishing callback, one rank in
this process; a Trainer asked to publish without the callback refuses."""

from __future__ import annotations

import json

import pytest

import recsys_dist
from recsys_dist.data.stream import convert_partition
from recsys_dist.errors import CheckpointError
from recsys_dist.section import ConfigError
from recsys_dist.serve.publish import latest_version, load_published
from recsys_dist.serve.publish_callback import PublishCallback
from recsys_dist.train.build import make_loaders
from tests.cli import read_metrics
from tests.conftest import QUICKSTART
from tests.unit.train.test_stream import CONFIG, NAMES, ROWS, TIMING, land, overrides


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


def _untimed(run) -> list[dict]:
    drop = (*TIMING, "wall_ms")
    return [{k: v for k, v in r.items() if k not in drop and not k.endswith("_ms")} for r in read_metrics(run)]


def test_a_second_fit_trains_what_landed_since_and_evaluate_takes_a_loader(tmp_path, monkeypatch):
    """fit() again on the same StreamTrainer trains the partitions landed after the first call
    (it returned at once, 'idle', training nothing): its numbers equal one fit over both. A
    StreamTrainer has no named split (evaluate() before fit raised AttributeError, after it
    returned {}): refused, saying what to pass; a loader is scored with the weights held,
    the resumed ones before fit()."""
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(tmp_path / "cache"))
    extra = ["distributed.nproc_per_node=1", "train.batch_size=64"]

    def trainer(landing, run, **kw):
        cfg = recsys_dist.load_config(CONFIG, [*overrides(landing), *extra])
        return recsys_dist.StreamTrainer(cfg, run, callbacks=[PublishCallback(cfg.publish, run)], **kw)

    for name in NAMES[:2]:
        land(tmp_path / "all", name)
    with trainer(tmp_path / "all", tmp_path / "once") as t:
        once = t.fit()
    land(tmp_path / "landing", NAMES[0])
    with trainer(tmp_path / "landing", tmp_path / "twice") as t:
        first = t.fit()
        land(tmp_path / "landing", NAMES[1])
        second = t.fit()
        assert first["partitions"] == NAMES[:1] and second["partitions"] == NAMES[:2] == once["partitions"]
        assert (first["steps"], second["steps"], second["rows_trained"]) == (10, 20, 2 * ROWS)
        assert second["validation"] == once["validation"] and second["stopped"] == "idle"
        for split in ("validation", "test", "train"):
            with pytest.raises(ValueError, match=f"a StreamTrainer has no '{split}' split to score: "):
                t.evaluate(split)
        with pytest.raises(ValueError, match="pass a loader of the rows: trainer.evaluate\\(loader\\)"):
            t.predict()
        part = convert_partition(t.job.data, NAMES[1], tmp_path / "conv")
        loader = make_loaders(t.job.with_data(part.prepared), t.ctx).train.reopen(shuffle=False, remainder="pad")
        held = t.evaluate(loader)
    assert held["num_examples"] == ROWS
    assert _untimed(tmp_path / "twice") == _untimed(tmp_path / "once")
    assert latest_version(tmp_path / "twice" / "publish") == 2
    with trainer(tmp_path / "landing", tmp_path / "twice", resume="auto") as resumed:
        with pytest.raises(ValueError, match="a StreamTrainer has no 'validation' split to score"):
            resumed.evaluate()
        assert resumed.step == 20 and resumed.evaluate(loader) == held  # before fit: the resumed weights
