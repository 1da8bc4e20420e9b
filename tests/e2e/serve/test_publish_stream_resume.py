"""A stream run's own publish directory with a damaged delta (issue 40 item 4): `--resume auto`
goes on with a full version numbered after every version (a server following it never goes
back), and meanwhile `serve` and `export --from-publish` take the newest intact version, with
a warning, instead of failing. One 1-rank stream run of the online config over 2 partitions,
then its resume over a third; then a damaged manifest.json (rebuilt by the next resume, over a
fourth partition), and a resume given another run's publish.dir (refused before training)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from recsys_dist.serve.export import load
from recsys_dist.serve.http import ModelHolder, open_source
from recsys_dist.serve.publish import load_published
from recsys_dist.serve.quantize import published_state
from tests.cli import run_cli, run_train
from tests.conftest import ROOT

CONFIG = ROOT / "configs" / "criteo_online.yaml"
SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"
ROWS = 320  # per partition: 10 batches of 32 on 1 rank
NAMES = [f"day=0/hour={h:02d}/part-0.txt" for h in range(4)]


def land(landing: Path, i: int) -> None:
    """Partition ``i`` landed as a producer should: a hidden file renamed into place, its
    modification time in the past (a file that has stopped changing)."""
    lines = SAMPLE.read_bytes().splitlines(keepends=True)[i * ROWS : (i + 1) * ROWS]
    target = landing / NAMES[i]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp"
    tmp.write_bytes(b"".join(lines))
    os.replace(tmp, target)
    past = time.time() - 3600
    os.utime(target, (past, past))


def versions(d: Path) -> list[tuple]:
    return [(e["version"], e["kind"], e["step"]) for e in json.loads((d / "manifest.json").read_text())["versions"]]


def same(a, b) -> bool:
    a, b = published_state(a), published_state(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # a stream run and its resume
def test_a_damaged_delta_in_its_own_publish_dir_does_not_stop_a_stream_resume(tmp_path, caplog):
    landing, run = tmp_path / "landing", tmp_path / "run"
    land(landing, 0), land(landing, 1)
    keys = {
        "data.stream.path": landing,
        "data.stream.poll_seconds": 0.2,
        "data.stream.stop_after_idle_seconds": 0,
        "data.num_embeddings": 2000,
        "distributed.nproc_per_node": 1,
        "train.progress_bar": "false",
        "checkpoint.keep": 5,
    }
    overrides = [f"{k}={v}" for k, v in keys.items()]
    env = {"RECSYS_DIST_CACHE": str(tmp_path / "cache")}
    r = run_train(CONFIG, run, *overrides, tmp=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    d = run / "publish"
    assert versions(d) == [(1, "full", 10), (2, "delta", 20)]
    delta = d / "v000002" / "delta.safetensors"
    data = bytearray(delta.read_bytes())
    data[-1] ^= 0xFF
    delta.write_bytes(bytes(data))

    # serve and export take the newest intact version, with a warning
    with caplog.at_level(logging.WARNING, logger="recsys_dist.serve"):
        holder = ModelHolder(open_source(d), reload_seconds=0)
    assert holder.current.version == 1 and (holder.latest, holder.stuck["version"]) == (2, 2)
    assert "now serving version 1, the newest intact one" in caplog.text
    out = tmp_path / "export"
    r = run_cli(["export", "--from-publish", d, "--out", out], tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"warning: version 2, the latest of {d}, cannot be loaded" in r.stderr
    assert "v000002/delta.safetensors: damaged" in r.stderr and "exporting version 1" in r.stderr
    assert f"exported version 1 (step 10) of the publish {d}" in r.stdout
    assert same(load(out).model, load_published(d, 1)[0].model)
    r = run_cli(["export", "--from-publish", d, "--version", "2", "--out", tmp_path / "x"], tmp_path)
    assert r.returncode != 0 and "v000002/delta.safetensors: damaged" in r.stderr  # asked for: not replaced
    assert "ask for an earlier version (--version 1 of serve or export --from-publish" in r.stderr  # the CLI's
    assert "publish again" not in r.stderr  # (was: load_published(..., version=1), and a command that does not exist)
    r = run_cli(["export", run, "--version", "2", "--out", tmp_path / "y"], tmp_path)
    assert r.returncode == 2 and "--version 2 picks a version of --from-publish DIR" in r.stderr

    # the resume goes on: the resumed checkpoint is published again as a full version, numbered 3
    land(landing, 2)
    r = run_train(CONFIG, run, *overrides, "--resume", "auto", tmp=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "version(s) 2" in r.stderr and "the newest intact one" in r.stderr
    assert versions(d) == [(1, "full", 10), (3, "full", 20), (4, "delta", 30)]
    assert [x.name.split("-")[0] for x in (d / "dropped").iterdir()] == ["v000002"]
    for version, step in ((3, 20), (4, 30)):
        assert same(load_published(d, version)[0].model, load(run / "checkpoints" / f"step_{step:08d}").model)
    assert holder.poll() and holder.current.version == 4 and holder.stuck is None  # forward, 1 -> 4

    # a damaged manifest.json: the server keeps version 4; the resume rebuilds it and goes on
    (d / "manifest.json").write_text("{")
    assert not holder.poll() and holder.stuck["version"] is None and holder.current.version == 4
    land(landing, 3)
    r = run_train(CONFIG, run, *overrides, "--resume", "auto", tmp=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "manifest.json is damaged; rebuilt from the version directories' version.json" in r.stderr
    assert versions(d) == [(1, "full", 10), (3, "full", 20), (4, "delta", 30), (5, "full", 40)]
    assert same(load_published(d, 5)[0].model, load(run / "checkpoints" / f"step_{40:08d}").model)
    assert holder.poll() and holder.current.version == 5 and holder.stuck is None

    # another run's publish directory given to a resume: refused before anything trains
    other = tmp_path / "other_publish"
    shutil.copytree(d, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "run_dir": str(tmp_path / "other_run")}))
    r = run_train(CONFIG, run, *overrides, "--resume", "auto", f"publish.dir={other}", tmp=tmp_path, env=env)
    assert r.returncode != 0 and f"publish.dir {other} holds versions 1..5 of another run" in r.stderr
    assert "Traceback" not in r.stderr and versions(other) == versions(d)
