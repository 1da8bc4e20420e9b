"""Incremental reload of a publish directory (recsys_dist.serve.publish.apply_versions, the
server's PublishSource) and compaction (publish.full_every).

A reload from version k to m folds only the deltas k+1..m into a copy of the served model; its
state must equal ``load_published(dir, m)`` (the full fold, the independent reference) bit for
bit, across compactions, drops and restarted chains, fp32 and int8, and the served model must
stay as it was. One 1-rank run of the quickstart's DLRM saves a checkpoint at each of 6 steps;
the tests publish those checkpoints themselves.
"""

import errno
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from starlette.testclient import TestClient

from recsys_dist.cli.main import build_parser
from recsys_dist.errors import CheckpointError, ConfigError
from recsys_dist.serve import publish
from recsys_dist.serve.export import load
from recsys_dist.serve.http import ModelHolder, PublishSource, create_app, open_source
from recsys_dist.serve.publish import Publisher, apply_versions, latest_version, load_published
from recsys_dist.serve.publish_callback import check_publish_dir
from recsys_dist.serve.quantize import published_state
from recsys_dist.train.config import PublishConfig
from tests.conftest import QUICKSTART
from tests.e2e.serve.conftest import ONE_RANK, cli


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


# ------------------------------------------------------------------ publishing faults (issue 40 item 4)

FOLLOW = PublishConfig(enabled=True, every_partition=True)


def _damage(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _checkpoint_state(path) -> dict:
    return published_state(load(path, preprocessing=False).model)


def _manifest(d) -> list[tuple]:
    return [(e["version"], e["kind"], e["step"]) for e in json.loads((d / "manifest.json").read_text())["versions"]]


@pytest.mark.slow  # the training run of the fixture
def test_a_resumed_publisher_goes_on_past_a_damaged_or_missing_latest_version(steps, tmp_path, caplog):
    """Was: the resumed run's Publisher folded the latest version to take it up, and a damaged
    delta failed every resume for good. Now it goes on from the newest intact version with a
    full one, numbered after every version, and drops the damaged ones."""
    d = tmp_path / "pub"
    p = Publisher(d, FOLLOW)
    for c in steps[:4]:
        p.publish(c)  # v1 full, v2..v4 deltas (steps 1..4)
    _damage(d / "v000004" / "delta.safetensors")
    caplog.set_level(logging.WARNING, logger="recsys_dist")
    p = Publisher(d, FOLLOW, resume_step=4, lock=True)
    assert p.version == 3 and p.step == 3  # on_resume publishes the resumed step again (3 != 4)
    assert "version(s) 4" in caplog.text and "v000004/delta.safetensors: damaged" in caplog.text
    assert "numbered 5" in caplog.text
    assert latest_version(d) == 4  # listed until a version replaces it
    new = p.publish(steps[3])
    assert new.name == "v000005" and json.loads((new / "version.json").read_text())["kind"] == "full"
    assert _manifest(d) == [(1, "full", 1), (2, "delta", 2), (3, "delta", 3), (5, "full", 4)]
    assert [x.name.split("-")[0] for x in (d / "dropped").iterdir()] == ["v000004"]
    _assert_equal(_state(load_published(d)[0]), _checkpoint_state(steps[3]), "v5")
    assert p.publish(steps[4]).name == "v000006"  # and deltas on it again
    _assert_equal(_state(load_published(d)[0]), _checkpoint_state(steps[4]), "v6")
    del p
    # a missing version directory (deleted by hand) is passed over the same way
    shutil.rmtree(d / "v000006")
    p = Publisher(d, FOLLOW, resume_step=5)
    assert p.version == 5 and p.publish(steps[4]).name == "v000007"
    assert _manifest(d)[-2:] == [(5, "full", 4), (7, "full", 5)]
    # missing and after the resumed step: not said to stay "the latest" (was: "it stays the latest until ...")
    shutil.rmtree(d / "v000007")
    caplog.clear()
    Publisher(d, FOLLOW, resume_step=4)
    assert "version(s) 7 (step 5) in" in caplog.text and "(v000007: missing already, so not loadable)" in caplog.text


@pytest.mark.slow  # the training run of the fixture
def test_a_server_serves_the_newest_intact_version_reports_it_and_retries_a_repaired_one(
    steps, tmp_path, monkeypatch, caplog
):
    """Was: a damaged latest version stopped `serve` at start (exit), and a reload that failed
    was never tried again, even once repaired; /health did not say a reload was stuck."""
    d = tmp_path / "pub"
    p = Publisher(d, FOLLOW)
    for c in steps[:3]:
        p.publish(c)
    delta = d / "v000003" / "delta.safetensors"
    good = delta.read_bytes()
    _damage(delta)
    with caplog.at_level(logging.WARNING, logger="recsys_dist.serve"):
        holder = ModelHolder(PublishSource(d, publish), reload_seconds=0)
    assert holder.current.version == 2 and "now serving version 2, the newest intact one" in caplog.text
    _assert_equal(_state(holder.current.loaded), _checkpoint_state(steps[1]), "v2")
    with TestClient(create_app(holder)) as c:
        h = c.get("/health").json()
    assert (h["status"], h["version"], h["latest"], h["stuck"]["version"]) == ("ok", 2, 3, 3)
    assert "v000003/delta.safetensors: damaged" in h["stuck"]["error"] and h["stuck"]["since"].endswith("+00:00")
    reads = _Reads(monkeypatch)
    assert not holder.poll() and reads.take() == (0, [])  # not read again while its files are unchanged
    delta.write_bytes(good)  # repaired
    assert holder.poll() and holder.current.version == 3 and holder.stuck is None
    assert reads.take() == (0, ["v000003"])  # folded onto the served version 2
    _assert_equal(_state(holder.current.loaded), _checkpoint_state(steps[2]), "v3")
    p.publish(steps[3])
    _damage(d / "v000004" / "delta.safetensors")
    assert not holder.poll() and holder.current.version == 3  # nothing intact newer: never back to 2
    assert (holder.latest, holder.stuck["version"]) == (4, 4)
    # serve --version N: that version only, whatever lands; a damaged one is refused
    pinned = ModelHolder(PublishSource(d, publish, version=2), reload_seconds=0)
    assert pinned.current.version == 2 and not pinned.poll() and pinned.current.version == 2
    with pytest.raises(CheckpointError, match="v000004/delta.safetensors: damaged"):
        ModelHolder(PublishSource(d, publish, version=4), reload_seconds=0)
    with pytest.raises(ConfigError, match="does not go with --wait"):
        open_source(d, wait=True, version=2)
    assert build_parser().parse_args(["serve", str(d), "--port", "0", "--version", "2"]).version == 2


@pytest.mark.slow  # the training run of the fixture
def test_a_publish_that_cannot_be_written_leaves_nothing_behind_and_says_what_it_needs(steps, tmp_path, monkeypatch):
    """Was: an OSError traceback, the version's .tmp directory left on the full disk."""
    d = tmp_path / "pub"
    p = Publisher(d, FOLLOW)
    p.publish(steps[0])
    before = sorted(x.name for x in d.iterdir())
    real = shutil.disk_usage
    monkeypatch.setattr(publish.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(CheckpointError, match=r"version 2 \(the checkpoint of step 2\) could not be written") as e:
        p.publish(steps[1])
    assert re.search(r"it needs about \d+\.\d MiB, 0\.0 MiB free there\)", str(e.value))
    assert f"to {d} ([Errno 28]" in str(e.value) and "version 1 is still the latest" in str(e.value)
    with pytest.raises(CheckpointError, match=r"Nothing of it was left there, and nothing is published there yet;"):
        Publisher(tmp_path / "first", FOLLOW).publish(steps[0])  # was: "and nothing is still the latest published"
    monkeypatch.setattr(publish.shutil, "disk_usage", real)

    def cut_short(tensors, path):  # a write the full disk cut short, as safetensors reports it
        Path(path).write_bytes(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(publish, "save_file", cut_short)
    with pytest.raises(CheckpointError, match=r"SafetensorError: .*No space left on device \(os error 28\)"):
        p.publish(steps[1])
    monkeypatch.undo()
    real_json = publish._write_json_atomic

    def manifest_full(path, obj):  # the version is whole and renamed; its manifest cannot be written
        if path.name == "manifest.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_json(path, obj)

    monkeypatch.setattr(publish, "_write_json_atomic", manifest_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        p.publish(steps[1])
    monkeypatch.undo()
    assert sorted(x.name for x in d.iterdir()) == before and latest_version(d) == 1
    assert p.publish(steps[1]).name == "v000002"  # the same publisher goes on once there is space
    _assert_equal(_state(load_published(d)[0]), _checkpoint_state(steps[1]), "v2")
    # what a killed publish left is removed when the directory is taken up again
    (d / ".tmp-v000003-99999").mkdir()
    (d / ".tmp-v000003-99999" / "delta.safetensors").write_bytes(b"\0" * 10)
    (d / ".manifest.json.tmp-99999").write_text("{")
    Publisher(d, FOLLOW, resume_step=2)
    assert sorted(x.name for x in d.iterdir()) == before + ["v000002"]


@pytest.mark.slow  # the training run of the fixture
def test_a_new_run_refuses_a_publish_dir_holding_versions_unless_overwrite(steps, tmp_path):
    """Was: a run from scratch took another run's directory and moved its versions to dropped/."""
    d = tmp_path / "pub"
    p = Publisher(d, FOLLOW)
    p.publish(steps[0]), p.publish(steps[1])
    del p
    message = rf"publish.dir {d} already holds versions 1..2 of another run.*publish.overwrite: true"
    with pytest.raises(CheckpointError, match=message):
        Publisher(d, FOLLOW, resume_step=0, lock=True, new_run=True)
    with pytest.raises(CheckpointError, match=message):  # recsys-dist train's check, before any rank
        check_publish_dir(PublishConfig(enabled=True, every_partition=True, dir=str(d)), tmp_path, resumed=False)
    with pytest.raises(CheckpointError, match="of another run"):  # nor a resumed one: they are the fixture run's
        check_publish_dir(PublishConfig(enabled=True, every_partition=True, dir=str(d)), tmp_path / "r", resumed=True)
    assert latest_version(d) == 2 and not (d / "dropped").exists()
    # unlisted versions (a first publish killed before its manifest) count too
    orphan = tmp_path / "orphan"
    (orphan / "v000001").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=rf"publish.dir {orphan} already holds v000001 of another run"):
        Publisher(orphan, FOLLOW, new_run=True)
    Publisher(tmp_path / "empty", FOLLOW, new_run=True)  # an empty (or new) directory is fine
    over = PublishConfig(enabled=True, every_partition=True, overwrite=True)
    p = Publisher(d, over, resume_step=0, lock=True, new_run=True)
    assert latest_version(d) == 2  # still served until this run's first version replaces them
    assert p.publish(steps[2]).name == "v000003" and _manifest(d) == [(3, "full", 3)]
    assert sorted(x.name.split("-")[0] for x in (d / "dropped").iterdir()) == ["v000001", "v000002"]


def _modes(d: Path) -> set[int]:
    return {stat.S_IMODE(p.stat().st_mode) for p in d.rglob("*") if p.is_file() and p.name != ".lock"}


@pytest.mark.slow  # the training run of the fixture
def test_a_damaged_manifest_keeps_the_server_serving_and_a_resume_rebuilds_it(steps, tmp_path, caplog):
    """Was: a damaged manifest.json in the run's own publish dir stopped every `--resume auto`,
    advising "delete R/publish and publish again" (no such command; doing it by hand numbered
    from 1 again: a server followed from version 7 to 2), and a server logged it at every
    reload tick. Now the resume rebuilds the list from each v*/version.json and goes on with a
    full version numbered after every version; the server says it once and keeps its model."""
    run = steps[0].parent.parent
    d = tmp_path / "pub"
    p = Publisher(d, FOLLOW, run_dir=run)
    for c in steps[:4]:
        p.publish(c)  # v1 full, v2..v4 deltas
    del p
    holder = ModelHolder(PublishSource(d, publish), reload_seconds=0)
    assert holder.current.version == 4
    (d / "manifest.json").write_text('{"format_version": 1, "lat')  # damaged
    (d / "v000004" / "version.json").write_text("{")  # and v4 cannot be listed again
    _damage(d / "v000003" / "delta.safetensors")  # nor v3 loaded
    with caplog.at_level(logging.WARNING, logger="recsys_dist.serve"):
        assert not any(holder.poll() for _ in range(3))
    assert caplog.text.count("cannot be read, still serving version 4") == 1  # once, not every tick
    assert holder.current.version == 4 and holder.stuck["version"] is None
    assert "manifest.json: damaged" in holder.stuck["error"] and "repair_manifest" in holder.stuck["error"]
    assert "publish again" not in holder.stuck["error"]
    with TestClient(create_app(holder)) as c:
        h = c.get("/health").json()
    assert (h["version"], h["stuck"]["version"]) == (4, None) and "manifest.json: damaged" in h["stuck"]["error"]
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="recsys_dist")
    p = Publisher(d, FOLLOW, resume_step=4, lock=True, run_dir=run)  # what the resumed run does
    assert "manifest.json is damaged; rebuilt from the version directories' version.json" in caplog.text
    assert "versions 1, 2, 3 listed, v000004 left out" in caplog.text
    assert p.version == 2 and "version(s) 3 in" in caplog.text  # v3's delta is damaged: goes on from v2
    assert _manifest(d) == [(1, "full", 1), (2, "delta", 2), (3, "delta", 3)]
    assert sorted(x.name.split("-")[0] for x in (d / "dropped").iterdir()) == ["manifest.json", "v000004"]
    assert not holder.poll() and holder.current.version == 4  # readable again, but never back to 3
    assert holder.stuck["version"] == 3 and "never goes back" in holder.stuck["error"]
    new = p.publish(steps[3])
    assert new.name == "v000005" and json.loads((new / "version.json").read_text())["kind"] == "full"
    assert _manifest(d) == [(1, "full", 1), (2, "delta", 2), (5, "full", 4)]
    assert "moved" in caplog.text and "replaced by version 5 (it could not be loaded)" in caplog.text
    assert holder.poll() and holder.current.version == 5 and holder.stuck is None
    _assert_equal(_state(holder.current.loaded), _checkpoint_state(steps[3]), "v5")
    assert p.publish(steps[4]).name == "v000006" and _manifest(d)[-1] == (6, "delta", 5)
    # Every published file, delta or full, has the mode of a plain open (deltas were 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert _modes(d) == {0o666 & ~umask}
    # repair_manifest does the rebuild by hand (a finished run resumes nothing)
    del p
    (d / "manifest.json").write_text("[]")
    with pytest.raises(CheckpointError, match="repair_manifest"):
        load_published(d)
    assert publish.repair_manifest(d) == [1, 2, 5, 6]
    assert load_published(d)[1] == 6 and json.loads((d / "manifest.json").read_text())["run_dir"] == str(run)


@pytest.mark.slow  # the training run of the fixture
def test_a_resumed_run_refuses_another_runs_publish_dir_unless_overwrite(steps, tmp_path, caplog):
    """Was: `--resume auto publish.dir=P`, P holding another run's versions, published deltas
    on top of them (a model neither run trained), silently."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    d = tmp_path / "pub"
    p = Publisher(d, FOLLOW, run_dir=other)
    p.publish(steps[0]), p.publish(steps[1])
    del p
    assert json.loads((d / "manifest.json").read_text())["run_dir"] == str(other.resolve())
    message = rf"publish.dir {d} holds versions 1..2 of another run \({other}\), and this run \({mine}\) resumes"
    cfg = PublishConfig(enabled=True, every_partition=True, dir=str(d))
    with pytest.raises(CheckpointError, match=message):  # recsys-dist train's check, before any rank
        check_publish_dir(cfg, mine, resumed=True)
    with pytest.raises(CheckpointError, match=message + r".*publish.overwrite: true"):
        Publisher(d, FOLLOW, resume_step=2, lock=True, run_dir=mine)
    check_publish_dir(cfg, other, resumed=True)  # its own run resumes
    assert Publisher(d, FOLLOW, resume_step=2, run_dir=other).version == 2
    # a run directory moved along with its publish directory is still the owner
    moved = tmp_path / "moved"
    shutil.copytree(d, moved / "publish")
    check_publish_dir(PublishConfig(enabled=True, every_partition=True), moved, resumed=True)
    # a manifest from before run_dir was recorded: its newest version's checkpoint names the run
    m = json.loads((d / "manifest.json").read_text())
    del m["run_dir"]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=rf"of another run \({steps[0].parent.parent}\)"):
        check_publish_dir(cfg, mine, resumed=True)
    # publish.overwrite takes it over: a full version after them, theirs dropped once it is published
    caplog.set_level(logging.WARNING, logger="recsys_dist")
    over = PublishConfig(enabled=True, every_partition=True, overwrite=True)
    p = Publisher(d, over, resume_step=3, lock=True, run_dir=mine)
    assert "version(s) 1 (step 1), 2 (step 2)" in caplog.text and "are another run's" in caplog.text
    assert latest_version(d) == 2  # still served until this run's first version
    new = p.publish(steps[2])
    assert new.name == "v000003" and _manifest(d) == [(3, "full", 3)]
    assert json.loads((d / "manifest.json").read_text())["run_dir"] == str(mine.resolve())
    assert "replaced by version 3 (another run's version, taken over (publish.overwrite))" in caplog.text
