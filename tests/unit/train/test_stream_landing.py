"""data.stream landing and restarts, one rank in this process: a file is taken once it has
stopped changing; a trained file that changes is warned about, a quarantined one retried;
bad rows skipped are counted; quarantines and empty partitions after the last step survive a
resume; a SIGTERM inside a logging window leaves the lines of an uninterrupted run."""

from __future__ import annotations

import os

import pytest
import yaml

import recsys_dist
from recsys_dist.data import stream as data_stream
from recsys_dist.data.config import StreamConfig
from recsys_dist.data.stream import convert_partition, ready, scan
from recsys_dist.errors import FileChanging
from tests.unit.train.test_stream import CONFIG, NAMES, SAMPLE, land, overrides

ONE_RANK = [
    "distributed.nproc_per_node=1",
    "train.batch_size=64",
    "publish.enabled=false",
    "publish.every_partition=false",
]  # 10 steps a partition


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(tmp_path / "cache"))


def test_ready_waits_for_the_age_or_the_marker(tmp_path):
    (tmp_path / "d").mkdir()
    f = tmp_path / "d" / "p.txt"
    f.write_text("x\n")
    os.utime(f, ns=(10**18, 10**18))  # modified at t = 1e9 s
    found = scan(StreamConfig(path=str(tmp_path)))
    assert found == {"d/p.txt": [2, 10**18]}
    aged = StreamConfig(path=str(tmp_path), min_file_age_seconds=5)
    assert not ready(aged, "d/p.txt", found["d/p.txt"], now=1e9 + 4.9)
    assert ready(aged, "d/p.txt", found["d/p.txt"], now=1e9 + 5)
    marked = StreamConfig(path=str(tmp_path), marker="_SUCCESS")
    assert not ready(marked, "d/p.txt", found["d/p.txt"], now=2e9)
    (tmp_path / "d" / "_SUCCESS").write_text("")
    assert ready(marked, "d/p.txt", found["d/p.txt"], now=0) and scan(marked) == found  # the marker is not data
    with pytest.raises(ValueError, match="must be a file name starting with '_' or '.'"):
        StreamConfig(path=str(tmp_path), marker="DONE")
    with pytest.raises(ValueError, match="min_file_age_seconds: not used with marker"):
        StreamConfig(path=str(tmp_path), marker="_SUCCESS", min_file_age_seconds=1)


def test_a_file_growing_while_it_is_converted_is_not_taken(tmp_path, monkeypatch):
    landing = tmp_path / "landing"
    land(landing, NAMES[0])
    cfg = recsys_dist.load_config(CONFIG, [*overrides(landing), *ONE_RANK]).data
    real = data_stream.prepare

    def prepare_while_written(*args, **kw):
        out = real(*args, **kw)
        with open(landing / NAMES[0], "ab") as f:  # the writer appends while the conversion runs
            f.write(SAMPLE.read_bytes().splitlines(keepends=True)[5000])
        return out

    monkeypatch.setattr(data_stream, "prepare", prepare_while_written)
    with pytest.raises(FileChanging, match="changed while it was read"):
        convert_partition(cfg, NAMES[0], tmp_path / "parts")
    assert not [p for p in (tmp_path / "parts").iterdir() if p.is_dir()]  # nothing of it kept
    with pytest.raises(FileChanging, match="vanished"):  # passed over, not quarantined
        convert_partition(cfg, "day=9/gone.txt", tmp_path / "parts")


def test_header_only_and_zero_byte_files_are_both_empty(tmp_path):
    """One rule for empty: a header line alone was quarantined as malformed ('the file holds
    no rows') while a 0-byte file was consumed."""
    landing = tmp_path / "landing"
    landing.mkdir()
    header = "userId,movieId,rating,timestamp,genres\n"
    (landing / "a.csv").write_text(header)
    (landing / "b.csv").write_bytes(b"")
    (landing / "c.csv").write_text(header + "1,2,4.0,3,Drama\n")
    tree = yaml.safe_load((CONFIG.parent / "movielens_deepfm.yaml").read_text())
    data = tree["data"]
    for key in ("raw_path", "split", "min_count"):
        data.pop(key, None)
    data.update(categorical_mapping="hash", stream={"path": str(landing)})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tree))
    d = recsys_dist.load_config(tmp_path / "c.yaml").data
    for name in ("a.csv", "b.csv"):
        part = convert_partition(d, name, tmp_path / "parts")
        assert (part.rows, part.prepared, part.skipped) == (0, None, 0), name
    assert convert_partition(d, "c.csv", tmp_path / "parts").rows == 1
