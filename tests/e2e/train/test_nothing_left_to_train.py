"""A resume with nothing left to train says so in the user's terms: the --run-dir given, not the
directory the checkpoint's run was first trained in (summary.json records that one, and it
differs once a run directory is copied or moved). In-process; the checkpoint is a stand-in
(meta.json, an empty .metadata and their checksums): nothing is loaded before the no-op is found."""

from recsys_dist.cli import main as cli
from tests.conftest import QUICKSTART
from tests.unit.train.test_nothing_left_to_train import OVERRIDES, _finished_run


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
