"""Incremental reload of a publish directory (recsys_dist.serve.publish.apply_versions, the
server's PublishSource) and compaction (publish.full_every).

A reload from version k to m folds only the deltas k+1..m into a copy of the served model; its
state must equal ``load_published(dir, m)`` (the full fold, the independent reference) bit for
bit, across compactions, drops and restarted chains, fp32 and int8, and the served model must
stay as it was. One 1-rank run of the quickstart's DLRM saves a checkpoint at each of 6 steps;
the tests publish those checkpoints themselves.
"""

import json
import logging

import pytest
import torch

from recsys_dist.config.loader import config_from_dict
from recsys_dist.errors import ConfigError
from recsys_dist.serve import publish
from recsys_dist.serve.config import PublishConfig
from recsys_dist.serve.export import load
from recsys_dist.serve.http import ModelHolder, PublishSource
from recsys_dist.serve.publish import Publisher, apply_versions, latest_version, load_published
from recsys_dist.serve.quantize import published_state
from tests.conftest import QUICKSTART
from tests.serving.conftest import ONE_RANK, cli


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """[checkpoint after step 1, ..., step 6] of one 1-rank run."""
    tmp = tmp_path_factory.mktemp("reload")
    run = tmp / "run"
    cli(
        ["train", "--config", QUICKSTART, "--run-dir", run, *ONE_RANK]
        + ["data.num_rows=2000", "train.max_steps=6", "train.batch_size=32"]
        + ["checkpoint.every_n_steps=1", "checkpoint.keep=10"],
        tmp,
    )
    paths = sorted((run / "checkpoints").glob("step_*"))
    assert len(paths) == 6
    return paths


def _state(loaded) -> dict:
    return published_state(loaded.model)


def _assert_equal(a: dict, b: dict, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (what, k)


class _Reads:
    """Counts what a reload reads: full versions loaded, delta files folded."""

    def __init__(self, monkeypatch):
        self.full, self.deltas = 0, []
        real_load, real_apply = publish.load, publish._apply_delta

        def counted_load(path, *a, **k):
            self.full += 1
            return real_load(path, *a, **k)

        def counted_apply(state, path):
            self.deltas.append(path.parent.name)
            return real_apply(state, path)

        monkeypatch.setattr(publish, "load", counted_load)
        monkeypatch.setattr(publish, "_apply_delta", counted_apply)

    def take(self):
        out = (self.full, self.deltas)
        self.full, self.deltas = 0, []
        return out


@pytest.mark.slow  # the training run of the fixture
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_incremental_reload_equals_the_full_fold(steps, tmp_path, monkeypatch, quantize):
    d = tmp_path / "pub"
    cfg = PublishConfig(enabled=True, every_partition=True, quantize=quantize, full_every=3)
    p = Publisher(d, cfg)
    p.publish(steps[0])
    holder = ModelHolder(PublishSource(d, publish), reload_seconds=0)
    reads = _Reads(monkeypatch)

    def reload_and_check(want_version, want_reads, what):
        before = holder.current
        old = _state(before.loaded)
        reads.take()  # the publishes' own checkpoint loads
        assert holder.poll(), what
        assert holder.current.version == want_version == latest_version(d), what
        assert reads.take() == want_reads, what
        ref, v = load_published(d, want_version)
        assert v == want_version and holder.current.loaded.source == ref.source, what
        _assert_equal(_state(holder.current.loaded), _state(ref), what)
        assert not holder.current.loaded.model.training, what
        # the model requests were using is untouched: still its own version, bit for bit
        _assert_equal(_state(before.loaded), old, (what, "old model"))
        published = [e["version"] for e in json.loads((d / "manifest.json").read_text())["versions"]]
        if before.version in published:  # (a version replaced after a resume is no longer published)
            _assert_equal(old, _state(load_published(d, before.version)[0]), (what, "old model"))

    assert holder.current.version == 1
    p.publish(steps[1]), p.publish(steps[2])
    reload_and_check(3, (0, ["v000002", "v000003"]), "two deltas on the served version 1")
    p.publish(steps[3])
    reload_and_check(4, (0, ["v000004"]), "one more delta")
    reads.take()
    assert not holder.poll() and reads.take() == (0, [])  # nothing new: nothing read
    assert [x.name for x in (p.publish(steps[4]), p.publish(steps[5]))] == ["v000005", "v000006"]
    kinds = [e["kind"] for e in json.loads((d / "manifest.json").read_text())["versions"]]
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta"]  # full_every: 3, compacted at v5
    reload_and_check(6, (1, ["v000006"]), "across a compaction: the new chain folded whole")
    p = Publisher(d, cfg, resume_step=5)  # a restart from step 5 drops v6 (step 6) once v7 replaces it
    reads.take()
    assert not holder.poll() and holder.current.version == 6 and reads.take() == (0, [])  # never rolled back
    p.publish(steps[5]), p.publish(steps[2])  # a new chain: v7 full (after the drop), v8 delta
    reload_and_check(8, (1, ["v000008"]), "the restarted chain")
    p.publish(steps[0])
    reload_and_check(9, (0, ["v000009"]), "incremental on the restarted chain")


@pytest.mark.slow  # the training run of the fixture
def test_a_damaged_delta_keeps_the_old_model_and_only_new_deltas_are_read(steps, tmp_path, caplog):
    d = tmp_path / "pub"
    p = Publisher(d, PublishConfig(enabled=True, every_partition=True))
    for c in steps[:3]:
        p.publish(c)
    holder = ModelHolder(PublishSource(d, publish), reload_seconds=0)
    assert holder.current.version == 3
    served = _state(holder.current.loaded)
    # an older delta damaged after it was loaded: a reload never reads it again
    old = d / "v000002" / "delta.safetensors"
    old.write_bytes(old.read_bytes()[:-1] + b"\x00")
    p.publish(steps[3])
    assert holder.poll() and holder.current.version == 4
    ref = load(steps[3], preprocessing=False).model.state_dict()  # the checkpoint itself, fp32
    got = holder.current.loaded.model.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    served = _state(holder.current.loaded)
    p.publish(steps[4])
    new = d / "v000005" / "delta.safetensors"
    data = bytearray(new.read_bytes())
    data[-1] ^= 0xFF
    new.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="recsys_dist.serve"):
        assert not holder.poll()
    assert "still serving version 4" in caplog.text and "v000005/delta.safetensors: damaged" in caplog.text
    assert holder.current.version == 4
    _assert_equal(_state(holder.current.loaded), served, "still version 4")
    p.publish(steps[5])  # v6 builds on the damaged v5: refused too
    assert not holder.poll() and holder.current.version == 4
    p = Publisher(d, PublishConfig(enabled=True, every_partition=True), resume_step=4)  # drops v5, v6
    p.publish(steps[5])  # v7: a full version
    assert holder.poll() and holder.current.version == 7
    ref = load(steps[5], preprocessing=False).model.state_dict()
    got = holder.current.loaded.model.state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    m, v = apply_versions(holder.current.loaded, d, 7, 7)  # nothing new: the same model
    assert v == 7 and m.model is holder.current.loaded.model


@pytest.mark.slow  # the training run of the fixture
def test_compaction_folds_bit_exactly_and_a_resumed_publisher_keeps_counting(steps, tmp_path):
    d = tmp_path / "pub"
    cfg = PublishConfig(enabled=True, every_partition=True, full_every=2)
    p = Publisher(d, cfg)
    p.publish(steps[0]), p.publish(steps[1])
    p = Publisher(d, cfg)  # taken up mid-chain: the delta already there counts
    for c in steps[2:]:
        p.publish(c)
    manifest = json.loads((d / "manifest.json").read_text())
    got = [(e["version"], e["kind"], e["base"]) for e in manifest["versions"]]
    assert got == [(1, "full", None), (2, "delta", 1), (3, "delta", 2), (4, "full", None), (5, "delta", 4)] + [
        (6, "delta", 5)
    ]
    for version, c in enumerate(steps, start=1):
        want = load(c, preprocessing=False).model.state_dict()
        have = load_published(d, version)[0].model.state_dict()
        assert have.keys() == want.keys() and all(torch.equal(have[k], want[k]) for k in want), version
    # a chain read from v1 up to v3, then on into the compacted chain: as the full fold
    m, v = load_published(d, 1)
    m, v = apply_versions(m, d, v, 3)
    assert v == 3 and "full v1 + 2 delta(s)" in m.source
    m, v = apply_versions(m, d, v)
    assert v == 6 and "full v4 + 2 delta(s)" in m.source
    _assert_equal(_state(m), _state(load(steps[5], preprocessing=False)), "v6")


def test_full_every_config():
    base = {"data": {"format": "criteo_tsv", "raw_path": "x.txt"}}
    ok = config_from_dict({**base, "publish": {"enabled": True, "every_partition": True, "full_every": 24}}, "c.yaml")
    assert ok.publish.full_every == 24
    default = config_from_dict({**base, "publish": {"enabled": True, "every_partition": True}}, "c.yaml")
    assert default.publish.full_every is None
    with pytest.raises(ConfigError, match="full_every"):
        config_from_dict({**base, "publish": {"enabled": True, "every_partition": True, "full_every": 0}}, "c.yaml")
    with pytest.raises(ConfigError, match="publish.full_every is set but publish.enabled is false"):
        config_from_dict({**base, "publish": {"full_every": 3}}, "c.yaml")
