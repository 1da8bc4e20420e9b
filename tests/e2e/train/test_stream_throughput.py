"""What a stream pays per partition: one training pipeline for the run (the model traced once,
not once per partition) and a publish from the model in memory (the checkpoint just written is
not read back), with the same versions, bit for bit, as publishing each checkpoint (one rank in
this process; tests/ranks/checkpoint/test_gather.py gathers shards across 2 ranks)."""

from __future__ import annotations

import json

import torchrec.distributed.train_pipeline.train_pipelines as torchrec_pipelines

import recsys_dist
from recsys_dist.serve import publish
from recsys_dist.serve.publish_callback import PublishCallback
from recsys_dist.train import steps
from tests.unit.train.test_stream import CONFIG, NAMES, land, overrides


def counted(monkeypatch, module, name: str) -> list:
    calls = []
    real = getattr(module, name)

    def call(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, call)
    return calls


def test_one_pipeline_per_run_and_versions_published_from_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(tmp_path / "cache"))
    landing, run = tmp_path / "landing", tmp_path / "run"
    for name in NAMES:
        land(landing, name)
    cfg = recsys_dist.load_config(
        CONFIG, [*overrides(landing), "distributed.nproc_per_node=1", "train.batch_size=64", "checkpoint.keep=20"]
    )
    made = counted(monkeypatch, steps, "make_pipeline")
    traces = counted(monkeypatch, torchrec_pipelines, "_rewrite_model")
    loads = counted(monkeypatch, publish, "load")  # serve.export.load: a checkpoint's tensors read back
    with recsys_dist.StreamTrainer(cfg, run, callbacks=[PublishCallback(cfg.publish, run)]) as trainer:
        summary = trainer.fit()
    assert summary["partitions"] == NAMES and summary["steps"] == 30
    assert len(made) == 1 and len(traces) == 1, (made, traces)  # before: one of each per partition
    assert loads == []  # before: one per version
    # The versions are those of the checkpoints, published from their files.
    monkeypatch.undo()
    ref = publish.Publisher(tmp_path / "ref", cfg.publish)
    for step in (10, 20, 30):
        ref.publish(run / "checkpoints" / f"step_{step:08d}")
    got, want = run / "publish", tmp_path / "ref"
    manifest = json.loads((got / "manifest.json").read_text())
    assert manifest["versions"] == json.loads((want / "manifest.json").read_text())["versions"]
    assert [(v["kind"], v["step"]) for v in manifest["versions"]] == [("full", 10), ("delta", 20), ("delta", 30)]
    for v in manifest["versions"]:
        info = json.loads((got / v["dir"] / "version.json").read_text())
        assert info["files"] == json.loads((want / v["dir"] / "version.json").read_text())["files"], v
        assert info["checkpoint"].endswith(f"step_{v['step']:08d}")
        for name in info["files"]:
            assert (got / v["dir"] / name).read_bytes() == (want / v["dir"] / name).read_bytes(), (v, name)
