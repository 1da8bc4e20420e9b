"""Symbolic links planted where recsys_dist writes are never written through (issue 40, item 8).

Every file a run, a publish or an export writes goes through ``recsys_dist.files``: whole files
are written under a new name and renamed over the link (which replaces the link itself), files
written in place (``.lock``, ``metrics.jsonl``) are opened with ``O_NOFOLLOW`` and a link, a
hard link or a FIFO there is refused with a message naming the path and the fix. Before, each
was opened through the link and its target truncated.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import stat

import pytest
import torch
from safetensors.torch import save_file

from recsys_dist.checkpoint.run_dir import WRITTEN_FILES, lock_run_dir
from recsys_dist.data.convert.cache import entry_lock
from recsys_dist.errors import CheckpointError, DataError, UnsafeFile
from recsys_dist.files import fresh_dir, open_in_place, write_atomic
from recsys_dist.section import ConfigError
from recsys_dist.serve.publish import Publisher
from recsys_dist.serve.publish_callback import check_publish_dir
from recsys_dist.train.config import PublishConfig
from recsys_dist.train.stream_state import BETWEEN_FILE, StreamState, record_between

VICTIM_TEXT = "the victim's data: never to be overwritten\n"


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "outside" / "victim.txt"
    v.parent.mkdir()
    v.write_text(VICTIM_TEXT)
    return v


def _plant(path, victim):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(victim)


def _plain(path):
    return stat.S_ISREG(os.lstat(path).st_mode)


def test_write_atomic_replaces_a_link_and_leaves_no_temporary_file(tmp_path, victim):
    d = tmp_path / "d"
    for name, target in (("link", victim), ("dangling", tmp_path / "nowhere" / "x")):
        _plant(d / name, target)
        write_atomic(d / name, "new\n")
        assert _plain(d / name) and (d / name).read_text() == "new\n"  # rename(2) replaced the link itself
    write_atomic(d / "bytes", b"\x00\x01")
    _plant(d / "by_writer", victim)
    write_atomic(d / "by_writer", lambda p: p.write_bytes(b"written by a path writer"))
    assert (d / "by_writer").read_bytes() == b"written by a path writer" and _plain(d / "by_writer")
    assert victim.read_text() == VICTIM_TEXT and not (tmp_path / "nowhere").exists()
    # A writer that fails leaves the old file and no temporary one.
    with pytest.raises(RuntimeError, match="boom"):
        write_atomic(d / "bytes", lambda p: (p.write_bytes(b"half"), (_ for _ in ()).throw(RuntimeError("boom"))))
    assert (d / "bytes").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in d.iterdir()) == ["by_writer", "bytes", "dangling", "link"]
    # The mode of a plain open: 0666 less the umask.
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(d / "link").st_mode) == 0o666 & ~umask


def test_open_in_place_refuses_links_hard_links_and_fifos(tmp_path, victim):
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    _plant(tmp_path / "sym", victim)
    with pytest.raises(UnsafeFile) as e:
        open_in_place(tmp_path / "sym", flags)
    message = str(e.value)
    assert f"{tmp_path / 'sym'} is a symbolic link (to {victim})" in message and f"rm {tmp_path / 'sym'}" in message
    assert isinstance(e.value, OSError) and e.value.filename == str(tmp_path / "sym")
    os.link(victim, tmp_path / "hard")
    with pytest.raises(UnsafeFile, match="hard is a file with 2 hard links"):
        open_in_place(tmp_path / "hard", flags)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafeFile, match="fifo is a FIFO"):  # refused, not blocked waiting for a reader
        open_in_place(tmp_path / "fifo", flags)
    assert victim.read_text() == VICTIM_TEXT
    fd = open_in_place(tmp_path / "plain", flags)  # a new plain file: an ordinary blocking descriptor
    try:
        assert os.get_blocking(fd) and os.write(fd, b"x") == 1
    finally:
        os.close(fd)
    # The error crosses ranks (broadcast_result pickles it) unchanged.
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is UnsafeFile and str(again) == message


def test_fresh_dir_removes_a_link_not_its_target(tmp_path, victim):
    _plant(tmp_path / "step.tmp", victim.parent)
    fresh_dir(tmp_path / "step.tmp")
    assert (tmp_path / "step.tmp").is_dir() and not (tmp_path / "step.tmp").is_symlink()
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]


def test_locks_refuse_a_planted_link_naming_it_and_the_fix(tmp_path, victim):
    run = tmp_path / "run"
    _plant(run / ".lock", victim)
    with pytest.raises(
        ConfigError, match=r"--run-dir .*run: .*run/\.lock is a symbolic link .*\(rm .*run/\.lock\) and run again"
    ):
        lock_run_dir(run)
    publish = tmp_path / "publish"
    _plant(publish / ".lock", victim)
    with pytest.raises(UnsafeFile, match=r"publish/\.lock is a symbolic link"):
        Publisher(publish, PublishConfig(enabled=True, every_n_steps=5), lock=True)
    cache = tmp_path / "cache"
    _plant(cache / "entry.lock", victim)
    with pytest.raises(DataError, match=r"cache/entry\.lock is a symbolic link"), entry_lock(cache / "entry", []):
        pass
    assert victim.read_text() == VICTIM_TEXT
    (run / ".lock").unlink()
    with lock_run_dir(run):  # the link removed, the run takes its directory
        assert _plain(run / ".lock")


# ------------------------------------------------------------------ directories planted at file names


def test_a_directory_at_a_file_name_is_refused_before_the_run_naming_rm_r(tmp_path):
    """Was: an IsADirectoryError traceback once the whole run had trained (summary.json,
    plan.txt), "free disk space" (checkpoints/latest), "cannot write there" (config.yaml), `rm`
    for a directory (.lock). Now taking the run directory refuses it, naming `rm -r PATH`."""
    for name in [*WRITTEN_FILES, ".lock"]:
        run = tmp_path / "runs" / name.replace("/", "_")
        (run / name).mkdir(parents=True)
        with pytest.raises(ConfigError) as e:
            lock_run_dir(run)
        path = run / name
        assert f"{path} is a directory" in str(e.value) and f"(rm -r {path})" in str(e.value), name
        assert "link" not in str(e.value) and "disk" not in str(e.value), name
        (run / name).rmdir()
        with lock_run_dir(run):  # the directory removed, the run takes its directory
            pass
    # recsys_dist.files names a directory as one (not the temporary file, not as a link)
    (tmp_path / "summary.json").mkdir()
    with pytest.raises(UnsafeFile) as e:
        write_atomic(tmp_path / "summary.json", "{}")
    assert e.value.errno == errno.EISDIR and e.value.filename == str(tmp_path / "summary.json")
    assert f"(rm -r {tmp_path / 'summary.json'})" in str(e.value) and ".tmp" not in str(e.value)
    with pytest.raises(UnsafeFile, match=r"is a directory.*rm -r"):
        open_in_place(tmp_path / "summary.json", os.O_WRONLY | os.O_CREAT)
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_publish_dir_that_cannot_be_one_is_refused_before_the_run(tmp_path, victim):
    """Was: told only when the first version was published (after a partition trained), as
    "[Errno 17] File exists" or a link message from inside the publish."""
    cfg = PublishConfig(enabled=True, every_partition=True, dir="pub")
    (tmp_path / "pub").write_text("")
    with pytest.raises(CheckpointError, match=r"publish.dir .*pub is a file, not a directory"):
        check_publish_dir(cfg, tmp_path, resumed=False)
    (tmp_path / "pub").unlink()
    _plant(tmp_path / "pub" / ".lock", victim)
    with pytest.raises(CheckpointError, match=r"pub/\.lock is a symbolic link .*\(rm .*pub/\.lock\)"):
        check_publish_dir(cfg, tmp_path, resumed=True)
    (tmp_path / "pub" / ".lock").unlink()
    (tmp_path / "pub" / "manifest.json").mkdir()
    with pytest.raises(CheckpointError, match=r"pub/manifest\.json is a directory.*rm -r"):
        check_publish_dir(cfg, tmp_path, resumed=False)
    (tmp_path / "pub" / "manifest.json").rmdir()
    check_publish_dir(cfg, tmp_path, resumed=False)
    assert victim.read_text() == VICTIM_TEXT


def test_taking_a_run_dir_removes_the_temporary_files_a_killed_run_left(tmp_path):
    """Was: `.summary.json.X.tmp`, `checkpoints/.latest.X.tmp` left by a kill stayed for good."""
    run = tmp_path / "run"
    left = [run / ".summary.json.0badc0de.tmp", run / "checkpoints" / ".latest.12345678.tmp"]
    kept = [run / "notes.tmp", run / ".hidden.tmp", run / "checkpoints" / "step_00000004" / ".meta.json.0badc0de.tmp"]
    for p in left + kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    with lock_run_dir(run):
        assert not any(p.exists() for p in left) and all(p.exists() for p in kept)


def test_files_written_by_a_path_writer_get_the_mode_of_a_plain_open(tmp_path):
    """Was: safetensors writes 0600, so a delta (delta.safetensors) could not be read by a
    server running as another user, while a full version's files were 0644."""
    umask = os.umask(0o022)
    try:
        save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
        assert stat.S_IMODE(os.stat(tmp_path / "plain.safetensors").st_mode) == 0o600  # safetensors' own
        write_atomic(tmp_path / "w.safetensors", lambda p: save_file({"x": torch.zeros(2)}, str(p)))
        assert stat.S_IMODE(os.stat(tmp_path / "w.safetensors").st_mode) == 0o644
    finally:
        os.umask(umask)


def test_stream_position_beside_a_checkpoint_is_not_written_through_a_link(tmp_path, victim):
    # record_between wrote ``.stream.json.<pid>.tmp`` with a plain open, then renamed it: a link
    # planted at that guessable name had its target overwritten.
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    _plant(ckpt / f".{BETWEEN_FILE}.{os.getpid()}.tmp", victim)
    _plant(ckpt / BETWEEN_FILE, victim)
    record_between(ckpt, 3, StreamState(consumed=["p0"]))
    assert victim.read_text() == VICTIM_TEXT
    assert _plain(ckpt / BETWEEN_FILE)
    saved = json.loads((ckpt / BETWEEN_FILE).read_text())
    assert saved["step"] == 3 and saved["stream"]["consumed"] == ["p0"]
