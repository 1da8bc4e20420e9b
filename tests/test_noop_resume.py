"""A resume with nothing left to train says so in the user's terms: the --run-dir given, not the
directory the checkpoint's run was first trained in (summary.json records that one, and it
differs once a run directory is copied or moved). In-process; the checkpoint is a stand-in
(meta.json and an empty .metadata): nothing is loaded before the no-op is found."""

import json

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.cli import main as cli
from recsys_dist.cli.summary import print_summary
from recsys_dist.config import load_config
from tests.conftest import QUICKSTART

OVERRIDES = ["data.num_rows=500", "distributed.nproc_per_node=1", "train.max_steps=4"]


def _finished_run(run_dir, first_trained_in):
    ckpt = run_dir / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    cfg = load_config(QUICKSTART, OVERRIDES)
    (ckpt / "meta.json").write_text(json.dumps({"step": 4, "config": cfg.to_dict()}))
    (ckpt / ".metadata").write_text("")
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name)
    (run_dir / "summary.json").write_text(json.dumps({"run_dir": str(first_trained_in), "steps": 4}))
    return ckpt


def test_noop_resume_names_the_run_dir_given(tmp_path, cache_dir, capsys):
    moved = tmp_path / "moved_run"
    _finished_run(moved, tmp_path / "original_run")
    args = ["train", "--config", str(QUICKSTART), "--run-dir", str(moved), "--resume", "auto", *OVERRIDES]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"nothing to train: the run in {moved} is already at step 4 (checkpoint step_00000004)" in out
    assert "this config trains 4 steps in all" in out and "original_run" not in out
    # Another run's checkpoint resumed into a new directory: both named, as given.
    other = tmp_path / "new_run"
    ckpt = moved / "checkpoints" / "step_00000004"
    args = ["train", "--config", str(QUICKSTART), "--run-dir", str(other), "--resume", str(ckpt), *OVERRIDES]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {ckpt} (--resume) is already at step 4" in out
    assert f"nothing in {other} was trained or changed" in out


def test_trainer_noop_summary_names_the_run_dir_given(tmp_path, capsys):
    # What Trainer.fit returns for a no-op resume (under torchrun rank 0 prints it).
    moved = tmp_path / "moved_run"
    ckpt = _finished_run(moved, tmp_path / "original_run")
    summary = run_dirs.noop_summary(moved, ckpt, 4)
    assert summary["run_dir"] == str(moved) and summary["already_complete"]
    print_summary(summary)
    out = capsys.readouterr().out
    assert f"nothing to train: the run in {moved} is already at step 4" in out and "original_run" not in out
