"""Faults that must never corrupt a run directory (issue 21): restarts without a checkpoint,
a full disk or a read-only file system under metrics.jsonl, a torn last line, two runs in
one directory. One rank, in this process; the 2-rank cases (a rank killed mid-save, the
launcher SIGKILLed or SIGTERMed) are in test_run_faults_ranks.py.

"Equal to an uninterrupted run" compares every metrics.jsonl line but its timings.
"""

import json
import logging

import pytest

from recsys_dist.cli import main as cli
from recsys_dist.train.metrics_writer import MetricsError, MetricsWriter, read_metrics
from tests.conftest import QUICKSTART

TOY = [
    "data.num_rows=2000",
    "train.max_steps=8",
    "train.log_every_n_steps=2",
    "checkpoint.every_n_steps=4",
    "train.progress_bar=false",
    "train.deterministic=true",
    "distributed.nproc_per_node=1",
]


def lines(run_dir) -> list[dict]:
    """metrics.jsonl without timings (samples/s and the sampled step breakdown)."""
    return [
        {k: v for k, v in r.items() if k != "samples_per_s" and not k.endswith("_ms")}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def keys(run_dir) -> list[tuple]:
    return [(r["split"], r["step"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def train(run_dir, *extra, env=None, monkeypatch=None) -> int:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    try:
        return cli.main(["train", "--config", str(QUICKSTART), "--run-dir", str(run_dir), *TOY, *extra])
    finally:
        for k in env or {}:
            monkeypatch.delenv(k)


# ------------------------------------------------------------------ metrics.jsonl, no torch


def test_torn_last_line_is_dropped_and_a_torn_middle_line_is_named(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    good = [{"split": "train", "step": s, "epoch": 0, "loss": 0.5} for s in (2, 4, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"split": "train", "st')
    # Other in-process tests may have stopped it propagating, or raised the root's level.
    caplog.set_level(logging.WARNING, logger="recsys_dist")
    logger = logging.getLogger("recsys_dist")
    logger.addHandler(caplog.handler)
    try:
        assert read_metrics(path) == good
    finally:
        logger.removeHandler(caplog.handler)
    assert "dropped the incomplete last line 4" in caplog.text
    w = MetricsWriter(path, enabled=True)
    w.start(4)  # what a resume from step 4 does: the torn line and step 6 go
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in good[:2])
    w.start(0)  # a start from scratch empties it
    assert path.read_text() == ""

    path.write_text(json.dumps(good[0]) + '\n{"split": "tr\n' + json.dumps(good[1]) + "\n")
    with pytest.raises(MetricsError, match=r"metrics.jsonl, line 2: not a metrics record"):
        read_metrics(path)


def test_a_write_that_fails_mid_line_leaves_no_partial_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path, enabled=True)
    w.write(split="train", step=2, epoch=0, loss=0.5)
    before = path.read_bytes()
    monkeypatch.setenv("RECSYS_DIST_FAULT", "metrics_full:4:0")  # 17 bytes reach the disk, then ENOSPC
    with pytest.raises(MetricsError) as err:
        w.write(split="train", step=4, epoch=0, loss=0.4)
    assert "could not be written at step 4 ([Errno 28] No space left on device" in str(err.value)
    assert "--resume auto" in str(err.value)
    assert path.read_bytes() == before
    w.write(split="train", step=6, epoch=0, loss=0.3)  # the fault fires once
    assert [r["step"] for r in read_metrics(path)] == [2, 6]
