"""A damaged checkpoint and changed training data, as a user meets them through the command
line: a shard overwritten in place (64 KiB of zeros, same size) and a garbled meta.json are
named, ``--resume auto`` falls back to the newest intact checkpoint and gives the numbers of
a run resumed from it; appended training rows are refused (exit 2) unless
``--resume-on-new-data``."""

import json
import os
import shutil

import pytest

from tests.cli import read_metrics, run_cli, run_train
from tests.conftest import CRITEO_SAMPLE, QUICKSTART
from tests.e2e.checkpoint import test_resume as checkpoint_runs

# 1,600 train rows, global batch 96 (remainder dropped): 16 steps an epoch; one rank.
BASE = [*checkpoint_runs.BASE, *checkpoint_runs.WS[1], "checkpoint.every_n_steps=4"]


def train(tmp, run_dir, *extra, inprocess=None):
    return run_train(QUICKSTART, run_dir, *BASE, *extra, tmp=tmp, inprocess=inprocess)


def losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir, "train")}


def zeros_inside(path, size=64 << 10):
    """64 KiB of zeros written in the middle of ``path``: the file keeps its size."""
    before = path.stat().st_size
    assert before > 2 * size
    with open(path, "r+b") as f:
        f.seek(before // 2 - size // 2)
        f.write(b"\0" * size)
    assert path.stat().st_size == before


@pytest.mark.slow  # four short trainings (one rank)
def test_damaged_checkpoint_is_named_and_auto_resumes_from_the_newest_intact_one(tmp_path):
    ref = tmp_path / "ref"
    r = train(tmp_path, ref, "train.epochs=1")  # 16 steps
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "run"
    r = train(tmp_path, run, "train.epochs=1", "train.max_steps=10")
    assert r.returncode == 0, r.stderr[-2000:]
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000008", "step_00000010"]
    shard = max((ckpts / "step_00000010").glob("*.distcp"), key=lambda p: p.stat().st_size)
    zeros_inside(shard)

    # Named explicitly (latest, the path): refused before anything runs, naming the file and step 8.
    for ref_arg in ("latest", str(ckpts / "step_00000010")):
        r = train(tmp_path, run, "train.epochs=1", "--resume", ref_arg, inprocess=True)
        assert r.returncode == 1, r.stderr[-2000:]
        assert f"{shard}: its CRC-32 differs" in r.stderr and str(ckpts / "step_00000008") in r.stderr
    # auto: falls back to step 8, saying so, and continues as an uninterrupted run would.
    r = train(tmp_path, run, "train.epochs=1", "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{shard}: its CRC-32 differs" in r.stderr
    assert f"falling back to the newest intact checkpoint, {ckpts / 'step_00000008'}" in r.stderr
    assert losses(run) == losses(ref)  # exact: the same world size and plan
    assert json.loads((run / "summary.json").read_text())["resumed_at_step"] == 8

    # The finished run's newest checkpoint damaged: export, evaluate and predict refuse, naming the file.
    final = ckpts / "step_00000016"
    shard = max(final.glob("*.distcp"), key=lambda p: p.stat().st_size)
    zeros_inside(shard)
    raw = tmp_path / "rows.txt"
    raw.write_text("".join(CRITEO_SAMPLE.open().readlines()[:50]))
    for cmd in (
        ["export", str(run), "--out", str(tmp_path / "export")],
        ["evaluate", str(run), "--data", str(raw)],
        ["evaluate", "latest", "--run-dir", str(run), "--data", str(raw)],
        ["predict", str(final), "--data", str(raw), "--out", str(tmp_path / "p.parquet")],
    ):
        r = run_cli(cmd, tmp_path)
        assert r.returncode == 1, (cmd, r.stdout, r.stderr[-2000:])
        assert f"{shard}: its CRC-32 differs" in r.stderr and str(ckpts / "step_00000012") in r.stderr, cmd
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "export").exists() and not (tmp_path / "p.parquet").exists()

    # A garbled meta.json (the shard repaired by hand first): named, and auto names the checkpoint
    # it falls back to (step 12), then trains steps 13-16 as the uninterrupted run did.
    shutil.copy(ref / "checkpoints" / "step_00000016" / shard.name, shard)
    (final / "meta.json").write_text('{"step": 16, "epo')
    r = train(tmp_path, run, "train.epochs=1", "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{final / 'meta.json'}: not valid JSON" in r.stderr
    assert f"falling back to the newest intact checkpoint, {ckpts / 'step_00000012'}" in r.stderr
    assert losses(run) == losses(ref)


@pytest.mark.slow  # two short trainings (one rank, then two)
def test_resume_on_changed_training_data_is_refused_unless_asked(tmp_path):
    lines = CRITEO_SAMPLE.open().readlines()
    raw = tmp_path / "raw.txt"
    raw.write_text("".join(lines[:1000]))  # 800 train rows: 8 steps an epoch, 16 in all
    data = [f"data.raw_path={raw}", "data.num_rows=null"]
    run = tmp_path / "run"
    r = train(tmp_path, run, *data, "train.max_steps=5")
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((run / "checkpoints" / "step_00000005" / "meta.json").read_text())
    old = meta["data"]
    assert old["rows"] == 800 and len(old["fingerprint"]) == 16

    # The same rows with a new modification time: converted again, the same fingerprint.
    os.utime(raw, (1e9, 1e9))
    r = train(tmp_path, run, *data, "train.max_steps=5", "--resume", "auto", inprocess=True)
    assert r.returncode == 0 and "nothing to train" in r.stdout, r.stderr[-2000:]

    # 200 rows appended: refused before any rank starts, naming both splits and the flag.
    with raw.open("a") as f:
        f.write("".join(lines[1000:1200]))
    r = train(tmp_path, run, *data, "--resume", "auto", inprocess=True)
    assert r.returncode == 2, r.stderr[-2000:]
    for part in (
        f"800 training rows of {raw} (fingerprint {old['fingerprint']}",
        "960 training rows",
        "--resume-on-new-data",
    ):
        assert part in r.stderr, (part, r.stderr)
    assert max(losses(run)) == 5  # nothing trained or written

    # With the flag (on 2 ranks, the same global batch: the flag reaches the ranks): epoch 0
    # starts again from its first batch over the new rows (10 steps an epoch) at step 6, and
    # the run ends after 2 epochs, at step 5 + 2 x 10 = 25.
    data += ["distributed.nproc_per_node=2", "train.batch_size=48"]
    r = train(tmp_path, run, *data, "--resume", "auto", "--resume-on-new-data")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 25 and summary["resumed_at_step"] == 5
    steps = [m["step"] for m in read_metrics(run, "validation")]
    assert steps == [5, 15, 25]  # the first run's end (max_steps), then each epoch's end over the new data
    meta = json.loads((run / "checkpoints" / "step_00000025" / "meta.json").read_text())
    assert meta["data"]["rows"] == 960 and meta["data"]["fingerprint"] != old["fingerprint"]
    # The new data is now the run's: a plain resume has nothing left to train.
    r = train(tmp_path, run, *data, "--resume", "auto", inprocess=True)
    assert r.returncode == 0 and "nothing to train" in r.stdout, r.stderr[-2000:]
    # The flag alone is an unused option: an error.
    r = train(tmp_path, tmp_path / "other", *data, "--resume-on-new-data", inprocess=True)
    assert r.returncode == 2 and "--resume-on-new-data goes with --resume" in r.stderr
