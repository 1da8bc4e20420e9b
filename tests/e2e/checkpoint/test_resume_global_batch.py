"""A checkpoint resumed with another global batch (train.batch_size x ranks): the position in
its epoch is counted in batches of the checkpoint's size, so it is carried over in rows."""

import json
import shutil

import pytest

from tests.cli import run_train
from tests.conftest import QUICKSTART

# 1,600 train rows: 50 steps per epoch on 1 rank x 32, 25 on 2 ranks x 32; 2 epochs = 3,200 rows.
BASE = ["data.num_rows=2000", "train.epochs=2", "train.progress_bar=false", "checkpoint.keep=10"]


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow  # three short runs, one on 2 ranks
def test_resume_on_other_ranks_keeps_the_epoch_position_in_rows(tmp_path):
    # Stopped at step 30 on 1 rank: 960 of epoch 0's 1,600 rows trained.
    one = tmp_path / "one"
    r = run_train(QUICKSTART, one, *BASE, "distributed.nproc_per_node=1", "train.max_steps=30", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    # On 2 ranks the same per-rank batch is a global batch of 64: epoch 0 goes on at its batch 15
    # (rows 960..), 10 steps, then epoch 1's 25. Read as 30 batches of 64 (past the epoch's 25),
    # the rest of epoch 0 was skipped and the run ended at 2 x 25 steps: 50 steps, 2,240 rows, exit 0.
    two = tmp_path / "two"
    shutil.copytree(one, two)
    over = ("distributed.nproc_per_node=2", "checkpoint.every_n_steps=10")
    r = run_train(QUICKSTART, two, *BASE, *over, "--resume", "auto", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    got = summary(two)
    assert (got["steps"], got["rows_trained"], got["resumed_at_step"]) == (65, 3200, 30), got

    # Its step-40 checkpoint ends epoch 0 (15 + 10 batches of 64). On 1 rank (50 batches of 32 per
    # epoch) the run goes on with epoch 1: 50 steps. Read as batch 25 of 50, the second half of
    # epoch 0 was trained again: 115 steps, 4,000 rows.
    back = tmp_path / "back"
    shutil.copytree(two, back)
    for later in ("step_00000050", "step_00000060", "step_00000065"):
        shutil.rmtree(back / "checkpoints" / later)
    (back / "checkpoints" / "latest").write_text("step_00000040\n")
    r = run_train(QUICKSTART, back, *BASE, "distributed.nproc_per_node=1", "--resume", "auto", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    got = summary(back)
    assert (got["steps"], got["rows_trained"], got["resumed_at_step"]) == (90, 3200, 40), got
