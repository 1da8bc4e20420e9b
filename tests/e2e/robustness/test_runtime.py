"""Runtime faults stop cleanly, naming the step / row / column, and keep good checkpoints."""

import pytest

from tests.cli import run_cli, run_train
from tests.conftest import QUICKSTART


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    # A sane start writes checkpoints at steps 4 and 8; then the learning rate is raised to
    # 1e30 on resume and the loss overflows within a few steps.
    base = [
        "data.num_rows=2000",
        "train.progress_bar=false",
        "train.log_every_n_steps=2",
        "checkpoint.every_n_steps=4",
        "train.dense_optimizer=sgd",
    ]
    r = run_cli(["train", "--config", str(QUICKSTART), "--run-dir", str(run), *base, "train.max_steps=8"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli(
        [
            "train",
            "--config",
            str(QUICKSTART),
            "--run-dir",
            str(run),
            "--resume",
            "auto",
            *base,
            "train.dense_lr=1e30",
            "train.embedding_lr=1e30",
        ],
        tmp_path,
    )
    assert r.returncode == 1
    assert "non-finite training loss at step" in r.stderr
    assert "last good checkpoint:" in r.stderr and "step_00000008" in r.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000008"


@pytest.mark.slow
def test_one_rank_raising_ends_all_ranks_promptly(tmp_path):
    import time

    t0 = time.monotonic()
    r = run_train(
        QUICKSTART,
        tmp_path / "run",
        "data.num_rows=2000",
        "train.progress_bar=false",
        tmp=tmp_path,
        env={"RECSYS_DIST_FAULT": "raise:3:1"},
    )
    elapsed = time.monotonic() - t0
    assert r.returncode == 1
    # The failing rank's own error is the one reported, long before any collective timeout.
    assert "training failed on rank 1" in r.stderr and "injected failure on rank 1 at step 3" in r.stderr
    assert elapsed < 120


@pytest.mark.slow
def test_tiny_data_over_three_ranks_never_hangs(tmp_path):
    # 5 rows: 4 train rows over 3 ranks x batch 32 (ranks 1 and 2 get only padding),
    # 0 validation rows, 1 test row.
    r = run_train(
        QUICKSTART,
        tmp_path / "run",
        "data.num_rows=5",
        "distributed.nproc_per_node=3",
        "train.progress_bar=false",
        tmp=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trained 4 samples in 1 steps on 3 ranks" in r.stdout
