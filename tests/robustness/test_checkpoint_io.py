"""Checkpoint writes that fail (disk full, read-only directory) and tampered checkpoint files,
on one process: clear errors, the previous checkpoint intact, nothing unpickled."""

import errno
import pickle
import shutil

import pytest
import torch

from recsys_dist import checkpoint as ck
from recsys_dist.distributed import DistContext

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
    with pytest.raises(ck.CheckpointError, match=r"refusing to load builtins.print"):
        ck.load_checkpoint(path, _state(0.0))
    assert "pwned" not in capsys.readouterr().out
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ck.CheckpointError, match="not a readable DCP metadata file"):
        ck.load_checkpoint(path, _state(0.0))


def test_truncated_shard_is_reported_as_damage_naming_an_older_checkpoint(run):
    ck.save_checkpoint(CTX, run, 8, _state(2.0), {"step": 8})
    shard = next((run / "checkpoints" / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ck.CheckpointError, match=r"step_00000008 is damaged: .*--resume .*step_00000004"):
        ck.load_checkpoint(run / "checkpoints" / "step_00000008", _state(0.0))
