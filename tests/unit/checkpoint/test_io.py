"""Checkpoint writes that fail (disk full, read-only directory) and tampered checkpoint files,
on one process: clear errors, the previous checkpoint intact, nothing unpickled."""

import errno
import json
import pickle
import shutil

import pytest
import torch

from recsys_dist.checkpoint import dcp as ck
from recsys_dist.checkpoint import integrity, meta
from recsys_dist.distributed.env import DistContext

CTX = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 4), value)}, "rng": torch.get_rng_state()}


@pytest.fixture
def run(tmp_path):
    ck.save_checkpoint(CTX, tmp_path, 4, _state(1.0), {"step": 4})
    return tmp_path


def _assert_previous_intact(run, message):
    assert "step_00000004" in message and "--resume auto" in message
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004"]  # no partial step_8.tmp
    state = _state(0.0)
    ck.load_checkpoint(root / "step_00000004", state)
    assert torch.equal(state["model"]["w"], torch.full((64, 4), 1.0))


def test_disk_full_while_writing_keeps_the_previous_checkpoint(run, monkeypatch):
    monkeypatch.setenv("RECSYS_DIST_FAULT", "disk_full:8:0")
    with pytest.raises(ck.CheckpointError, match=r"step 8 could not be written .*No space left on device") as e:
        ck.save_checkpoint(CTX, run, 8, _state(2.0), {"step": 8})
    _assert_previous_intact(run, str(e.value))


def test_read_only_directory_keeps_the_previous_checkpoint(run, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    def read_only(self, path, mode):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    # Tests may run as root, for whom chmod does not make a directory read-only; the OS
    # raises this same OSError on a read-only mount.
    monkeypatch.setattr(FileSystem, "create_stream", read_only)
    with pytest.raises(ck.CheckpointError, match=r"Errno 30\] Read-only file system: .*step_00000008.tmp") as e:
        ck.save_checkpoint(CTX, run, 8, _state(2.0), {"step": 8})
    monkeypatch.undo()
    _assert_previous_intact(run, str(e.value))


def test_too_little_free_space_is_found_before_writing(run, monkeypatch):
    usage = shutil.disk_usage(run)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(ck.CheckpointError, match=r"MiB needed, 0.0 MiB free") as e:
        ck.save_checkpoint(CTX, run, 8, _state(2.0), {"step": 8})
    monkeypatch.undo()
    _assert_previous_intact(run, str(e.value))


class _Boom:
    def __reduce__(self):
        return (print, ("pwned",))


def test_tampered_metadata_is_never_unpickled(run, capsys):
    path = run / "checkpoints" / "step_00000004"
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    # The checksums find it first; without them (verify=False) the unpickler still refuses it.
    with pytest.raises(ck.CheckpointDamaged, match=r"step_00000004/.metadata: "):
        ck.load_checkpoint(path, _state(0.0))
    with pytest.raises(ck.CheckpointError, match=r"refusing to load builtins.print"):
        ck.load_checkpoint(path, _state(0.0), verify=False)
    assert "pwned" not in capsys.readouterr().out
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ck.CheckpointError, match="not a readable DCP metadata file"):
        ck.load_checkpoint(path, _state(0.0), verify=False)


def test_truncated_shard_is_reported_as_damage_naming_an_older_checkpoint(run):
    ck.save_checkpoint(CTX, run, 8, _state(2.0), {"step": 8})
    shard = next((run / "checkpoints" / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(
        ck.CheckpointError,
        match=r"step_00000008 is damaged: .*distcp: 100 bytes .*intact checkpoint is .*step_00000004",
    ):
        ck.load_checkpoint(run / "checkpoints" / "step_00000008", _state(0.0))


def _zeros_inside(path, size=64 << 10, at=512):
    """Overwrite ``size`` bytes of ``path`` with zeros in place: the file keeps its size."""
    before = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\0" * size)
    assert path.stat().st_size == before


def test_a_shard_overwritten_in_place_is_named_and_auto_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv(integrity.VERIFIED_ENV, "")  # what verification records is undone after the test
    from recsys_dist.checkpoint import run_dir as run_dirs

    def big(value):  # a shard of 256 KiB, so that 64 KiB of zeros land inside it
        return {"model": {"w": torch.full((256, 256), value)}, "rng": torch.get_rng_state()}

    for step in (4, 8):
        ck.save_checkpoint(CTX, tmp_path, step, big(float(step)), {"step": step}, keep=3)
    root = tmp_path / "checkpoints"
    old, new = root / "step_00000004", root / "step_00000008"
    listed = json.loads((new / integrity.CHECKSUMS_FILE).read_text())["files"]
    assert {".metadata", "meta.json"} < set(listed) and any(n.endswith(".distcp") for n in listed)
    shard = max(new.glob("*.distcp"), key=lambda p: p.stat().st_size)
    _zeros_inside(shard)

    with pytest.raises(ck.CheckpointDamaged, match=rf"{shard}: its CRC-32 differs") as e:
        ck.load_checkpoint(new, big(0.0))
    assert str(old) in str(e.value)  # the intact one to use instead
    for ref in ("latest", str(new), str(tmp_path)):  # named explicitly (a run directory too): refused
        with pytest.raises(ck.CheckpointDamaged, match=rf"{shard}: .*newest intact checkpoint is {old}"):
            run_dirs.resolve_resume(ref, tmp_path)
    warned = []
    assert run_dirs.resolve_resume("auto", tmp_path, warn=warned.append) == old  # auto falls back, saying so
    assert (
        len(warned) == 1
        and str(shard) in warned[0]
        and f"falling back to the newest intact checkpoint, {old}" in warned[0]
    )
    state = big(0.0)
    ck.load_checkpoint(old, state)
    assert torch.equal(state["model"]["w"], torch.full((256, 256), 4.0))

    # A garbled meta.json: named, and auto names the checkpoint it falls back to.
    shutil.rmtree(new)
    ck.save_checkpoint(CTX, tmp_path, 8, big(8.0), {"step": 8}, keep=3)
    (new / "meta.json").write_text('{"step": 8, "epo')
    warned.clear()
    assert run_dirs.resolve_resume("auto", tmp_path, warn=warned.append) == old
    assert f"{new / 'meta.json'}: not valid JSON" in warned[0] and str(old) in warned[0]
    # Every checkpoint damaged: auto does not start from scratch silently.
    _zeros_inside(next(old.glob("*.distcp")))
    with pytest.raises(ck.CheckpointDamaged, match=r"no intact checkpoint is left .*\(2 damaged\)"):
        run_dirs.resolve_resume("auto", tmp_path)
    # A checkpoint of format 1 (recsys_dist 0.1.0: no checkpoint_format, no checksums.json) is
    # refused, naming it, the format found and expected, and what to do; not taken for damage.
    (old / integrity.CHECKSUMS_FILE).unlink()
    (old / "meta.json").write_text(json.dumps({"step": 4}))
    with pytest.raises(ck.CheckpointError) as e:
        integrity.verify_checkpoint(old)
    assert not isinstance(e.value, ck.CheckpointDamaged)
    assert str(e.value) == (
        f"checkpoint {old} was written by an older recsys_dist (checkpoint format 1; this one reads format "
        f"{meta.CHECKPOINT_FORMAT} only): retrain, or use recsys_dist {meta.FORMAT_1_RELEASE} to evaluate or export it"
    )


def test_a_garbled_latest_or_best_marker_falls_back_to_the_newest_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(integrity.VERIFIED_ENV, "")
    from recsys_dist.checkpoint import run_dir as run_dirs

    for step in (4, 8):
        ck.save_checkpoint(CTX, tmp_path, step, _state(float(step)), {"step": step}, keep=3, best=step == 4)
    root = tmp_path / "checkpoints"
    new = root / "step_00000008"
    # Bytes that are not UTF-8 (was a UnicodeDecodeError traceback from evaluate / train --resume),
    # and a marker naming something outside checkpoints/.
    for garbage in (b"\xff\xfe\x00garbage", b"../../elsewhere\n", b""):
        (root / "latest").write_bytes(garbage)
        assert meta.latest_checkpoint(tmp_path) == new
        assert meta.named_checkpoint("latest", tmp_path) == new
        assert run_dirs.resolve_resume("auto", tmp_path) == new
        (root / "best").write_bytes(garbage)
        assert meta.best_checkpoint(tmp_path) is None
        with pytest.raises(ck.CheckpointError, match="no complete best checkpoint"):
            meta.named_checkpoint("best", tmp_path)
    # A save still works and rewrites the markers.
    ck.save_checkpoint(CTX, tmp_path, 12, _state(12.0), {"step": 12}, keep=3, best=True)
    assert meta.named_checkpoint("best", tmp_path) == meta.latest_checkpoint(tmp_path) == root / "step_00000012"


def test_a_lost_checksums_file_is_damage_not_an_old_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(integrity.VERIFIED_ENV, "")
    from recsys_dist.checkpoint import run_dir as run_dirs

    def big(value):
        return {"model": {"w": torch.full((256, 256), value)}, "rng": torch.get_rng_state()}

    for step in (4, 8):
        ck.save_checkpoint(CTX, tmp_path, step, big(float(step)), {"step": step}, keep=3)
    root = tmp_path / "checkpoints"
    old, new = root / "step_00000004", root / "step_00000008"
    # checksums.json gone and a shard overwritten: was loaded unchecked (as a checkpoint from
    # before checksums), giving zeros for the overwritten weights with no message.
    (new / integrity.CHECKSUMS_FILE).unlink()
    _zeros_inside(max(new.glob("*.distcp"), key=lambda p: p.stat().st_size))
    with pytest.raises(ck.CheckpointDamaged, match=rf"{new / integrity.CHECKSUMS_FILE}: the file is missing .*{old}"):
        ck.load_checkpoint(new, big(0.0))
    assert run_dirs.resolve_resume("auto", tmp_path, warn=lambda text: None) == old
    # meta.json records the format; one without it (format 1, recsys_dist 0.1.0, which wrote
    # checkpoints without checksums.json) is refused by every reader instead of loaded unchecked.
    saved = json.loads((old / "meta.json").read_text())
    assert saved.pop("checkpoint_format") == meta.CHECKPOINT_FORMAT == 2 and saved == {"step": 4}
    (old / "meta.json").write_text(json.dumps(saved))
    (old / integrity.CHECKSUMS_FILE).unlink()
    for read in (lambda: ck.load_checkpoint(old, big(0.0)), lambda: meta.read_meta(old)):
        with pytest.raises(ck.CheckpointError, match=rf"checkpoint {old} was written by an older recsys_dist "):
            read()
    # A newer format is refused too, asking for a newer recsys_dist.
    (old / "meta.json").write_text(json.dumps({**saved, "checkpoint_format": 3}))
    with pytest.raises(ck.CheckpointError, match=r"newer recsys_dist \(checkpoint format 3; this one reads format 2\)"):
        meta.read_meta(old)


def test_a_save_after_resuming_an_older_checkpoint_keeps_itself(tmp_path):
    # A run at step 12 (keep=3), resumed from step 4 (--resume PATH, best, or auto past damaged
    # ones), saves step 6: it counted 8 and 12 as newer and deleted itself, `latest` naming it.
    for step in (4, 8, 12):
        ck.save_checkpoint(CTX, tmp_path, step, _state(float(step)), {"step": step}, keep=3)
    ck.save_checkpoint(CTX, tmp_path, 6, _state(6.0), {"step": 6}, keep=2)
    root = tmp_path / "checkpoints"
    assert meta.latest_checkpoint(tmp_path) == root / "step_00000006"
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_00000004",
        "step_00000006",
        "step_00000008",
        "step_00000012",
    ]
    ck.save_checkpoint(CTX, tmp_path, 7, _state(7.0), {"step": 7}, keep=2)  # the newest 2 up to step 7
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_00000006",
        "step_00000007",
        "step_00000008",
        "step_00000012",
    ]
    state = _state(0.0)
    ck.load_checkpoint(meta.latest_checkpoint(tmp_path), state)
    assert torch.equal(state["model"]["w"], torch.full((64, 4), 7.0))


def test_a_file_size_limit_is_named_and_keeps_the_previous_checkpoint(run):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # `ulimit -f 64`: the 256 KiB shard fails
    try:
        with pytest.raises(ck.CheckpointError) as e:
            ck.save_checkpoint(CTX, run, 8, {"model": {"w": torch.full((256, 256), 2.0)}}, {"step": 8})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    # Was only torch's "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598".
    assert "files of at most 65,536 bytes (ulimit -f)" in str(e.value), str(e.value)
    _assert_previous_intact(run, str(e.value))


def test_a_data_sources_file_is_written_inside_the_checkpoint_and_checked(run, monkeypatch):
    """``files`` (a stream's carried histories): written before the rename, listed in
    checksums.json; missing or overwritten, the checkpoint is damage naming the file."""
    monkeypatch.delenv(integrity.VERIFIED_ENV, raising=False)
    path = ck.save_checkpoint(
        CTX, run, 8, _state(2.0), {"step": 8}, files={"histories.npz": lambda p: p.write_bytes(b"x" * 100)}
    )
    assert (path / "histories.npz").read_bytes() == b"x" * 100
    assert "histories.npz" in json.loads((path / integrity.CHECKSUMS_FILE).read_text())["files"]
    integrity.verify_checkpoint(path)
    (path / "histories.npz").write_bytes(b"y" * 100)
    monkeypatch.delenv(integrity.VERIFIED_ENV, raising=False)
    with pytest.raises(ck.CheckpointDamaged, match=r"histories.npz: its CRC-32 differs"):
        integrity.verify_checkpoint(path)
    (path / "histories.npz").unlink()
    with pytest.raises(ck.CheckpointDamaged, match=r"histories.npz: the file is missing"):
        integrity.verify_checkpoint(path)
