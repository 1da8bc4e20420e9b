"""A resume with nothing left to train says so in the user's terms: the --run-dir given, not the
directory the checkpoint's run was first trained in (summary.json records that one, and it
differs once a run directory is copied or moved). In-process; the checkpoint is a stand-in
(meta.json, an empty .metadata and their checksums): nothing is loaded before the no-op is found."""

import json

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.integrity import CHECKSUMS_FILE, file_sum
from recsys_dist.checkpoint.meta import CHECKPOINT_FORMAT
from recsys_dist.config.loader import load_config
from recsys_dist.train.summary import print_summary
from tests.conftest import QUICKSTART

OVERRIDES = ["data.num_rows=500", "distributed.nproc_per_node=1", "train.max_steps=4"]


def _finished_run(run_dir, first_trained_in):
    ckpt = run_dir / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    cfg = load_config(QUICKSTART, OVERRIDES)
    meta = {"step": 4, "config": cfg.to_dict(), "checkpoint_format": CHECKPOINT_FORMAT}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / ".metadata").write_text("")
    # As save_checkpoint writes it: every file's size and CRC-32 (--resume auto verifies them).
    files = {n: file_sum(ckpt / n) for n in ("meta.json", ".metadata")}
    (ckpt / CHECKSUMS_FILE).write_text(json.dumps({"algorithm": "crc32", "files": files}))
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name)
    (run_dir / "summary.json").write_text(json.dumps({"run_dir": str(first_trained_in), "steps": 4}))
    return ckpt


def test_trainer_noop_summary_names_the_run_dir_given(tmp_path, capsys):
    # What Trainer.fit returns for a no-op resume (under torchrun rank 0 prints it).
    moved = tmp_path / "moved_run"
    ckpt = _finished_run(moved, tmp_path / "original_run")
    summary = run_dirs.noop_summary(moved, ckpt, 4)
    assert summary["run_dir"] == str(moved) and summary["already_complete"]
    print_summary(summary)
    out = capsys.readouterr().out
    assert f"nothing to train: the run in {moved} is already at step 4" in out and "original_run" not in out
