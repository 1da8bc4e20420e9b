"""data.stream: partitions landing while 2 ranks train; each row once across a kill, a resume
and a SIGTERM; progressive validation; quarantine; a version published per partition, served
hot and equal to `predict` on the folded export; managed-collision counters per partition."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.data.config import StreamConfig
from recsys_dist.data.stream import landed
from recsys_dist.section import ConfigError
from recsys_dist.train.preflight import check_before_launch
from tests.conftest import ROOT

CONFIG = ROOT / "configs" / "criteo_online.yaml"
SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"
ROWS = 640  # per partition: 10 global batches of 64 on 2 ranks
NAMES = ["day=0/hour=00/part-0.txt", "day=0/hour=01/part-0.txt", "day=0/hour=02/part-0.txt"]
BAD = "day=0/hour=01/part-1.txt"  # lands with hour 01: its 3rd line has 12 fields
TIMING = ("samples_per_s", "seconds")


def overrides(landing: Path, **extra) -> list[str]:
    keys = {
        "data.stream.path": str(landing),
        "data.stream.poll_seconds": "0.2",
        "data.stream.stop_after_idle_seconds": "0",
        "data.num_embeddings": "2000",
        "checkpoint.every_n_steps": "4",
        "train.log_every_n_steps": "3",
        "train.progress_bar": "false",
        "train.deterministic": "true",
        **extra,
    }
    return [f"{k}={v}" for k, v in keys.items()]


def land(landing: Path, name: str) -> None:
    """Land one partition as a writer would: a hidden file, then a rename."""
    lines = SAMPLE.read_bytes().splitlines(keepends=True)
    if name == BAD:
        part = lines[5000:5010]
        part[2] = b"\t".join(part[2].split(b"\t")[:12]) + b"\n"
    else:
        i = NAMES.index(name)
        part = lines[i * ROWS : (i + 1) * ROWS]
    target = landing / name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp"
    tmp.write_bytes(b"".join(part))
    os.replace(tmp, target)


def test_landed_takes_finished_files_in_name_order(tmp_path):
    for name in ["b/2.txt", "a/10.txt", "a/9.txt", ".a/x.txt", "a/.3.txt.tmp", "_SUCCESS", "a/_temporary/1.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert landed(StreamConfig(path=str(tmp_path))) == ["a/10.txt", "a/9.txt", "b/2.txt"]
    assert landed(StreamConfig(path=str(tmp_path), pattern="b/*.txt")) == ["b/2.txt"]


@pytest.mark.parametrize(
    "override, message",
    [
        (["data.raw_path=x.txt"], "data.raw_path: not used with data.stream"),
        (["data.split=[0.5,0.25,0.25]"], "data.split: not used with data.stream"),
        (["data.categorical_mapping=vocabulary"], "vocabulary needs the whole training data"),
        (["data.remainder=drop"], "data.remainder: drop would leave out"),
        (["data.num_rows=100"], "data.num_rows: not used with data.stream"),
        (["data.cache_dir=/tmp/x"], "data.cache_dir: not used with data.stream"),
        (["data.stream.poll_seconds=0"], "poll_seconds"),
    ],
)
def test_stream_section_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG, override)


def test_stream_refuses_what_it_does_not_use(tmp_path):
    cfg = load_config(
        CONFIG,
        [
            f"data.stream.path={tmp_path / 'absent'}",
            "train.epochs=2",
            "eval.every_n_steps=5",
            "train.early_stopping.patience=2",
        ],
    )
    with pytest.raises(ConfigError) as err:
        check_before_launch(resolve_job(cfg), memory=False)
    text = str(err.value)
    for key in ("train.epochs", "eval.every_n_steps", "train.early_stopping", "data.stream.path"):
        assert f"{key}:" in text, text


def test_a_stream_trainer_refuses_a_split_name_before_fit(tmp_path, monkeypatch, cache_dir):
    """evaluate() / predict() by split name on a StreamTrainer: a stream has no such split
    (before fit it raised AttributeError: 'NoneType' object has no attribute 'weight_column')."""
    import recsys_dist
    from recsys_dist.serve.publish_callback import PublishCallback

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    land(tmp_path / "landing", NAMES[0])
    cfg = load_config(CONFIG, [*overrides(tmp_path / "landing"), "distributed.nproc_per_node=1"])
    run = tmp_path / "run"
    with recsys_dist.StreamTrainer(cfg, run, callbacks=[PublishCallback(cfg.publish, run)]) as trainer:
        for call, split in ((trainer.evaluate, "validation"), (trainer.predict, "test"), (trainer.evaluate, "train")):
            with pytest.raises(ValueError) as err:
                call(split)
            assert f"a StreamTrainer has no {split!r} split to score" in str(err.value)
            assert "pass a loader of the rows: trainer.evaluate(loader) / trainer.predict(loader)" in str(err.value)
        assert trainer.step == 0


def test_a_checkpoint_without_or_with_damaged_histories_is_refused_naming_the_file(tmp_path):
    """data.stream.histories: carry resumes from the checkpoint's histories.npz: written and read
    back exactly; missing (a per_partition run's checkpoint) or damaged, a CheckpointError names
    the file and the fix, never empty histories."""
    from collections import deque

    from recsys_dist.data.config import SchemaConfig
    from recsys_dist.errors import CheckpointError
    from recsys_dist.train.stream_state import HISTORIES_FILE, histories_file, load_histories

    h = SchemaConfig(
        label="c", categorical=["i"], history={"user": "u", "item": "i", "time": "t", "max_length": 3}
    ).history
    state = {7: ((deque([1, 2], 3), deque([1.0, 2.0], 3), deque([0, 0], 3)), 5.0, [(9, 5.0, 0)])}
    with pytest.raises(CheckpointError, match=rf"{HISTORIES_FILE}: missing: .*data.stream.histories=per_partition"):
        load_histories(tmp_path, h)
    (tmp_path / HISTORIES_FILE).write_bytes(histories_file(state, h))
    got = load_histories(tmp_path, h)
    assert {u: ([list(c) for c in com], at, p) for u, (com, at, p) in got.items()} == {
        7: ([[1, 2], [1.0, 2.0], [0, 0]], 5.0, [(9, 5.0, 0)])
    }
    other = SchemaConfig(
        label="c", categorical=["i"], history={"user": "u", "item": "i", "time": "t", "max_length": 4}
    ).history
    with pytest.raises(CheckpointError, match="cannot be used: derived under data.schema.history"):
        load_histories(tmp_path, other)
    data = (tmp_path / HISTORIES_FILE).read_bytes()
    (tmp_path / HISTORIES_FILE).write_bytes(data[:-40])
    with pytest.raises(CheckpointError, match=rf"{HISTORIES_FILE}: the carried user histories cannot be used"):
        load_histories(tmp_path, h)
