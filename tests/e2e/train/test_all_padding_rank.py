"""Issue 30 item 1 as the user ran it, smaller: ``recsys-dist train`` of configs/movielens_din.yaml
on 2 ranks, whose last batch of the epoch is padding only on rank 1, finishes and counts its rows.
"""

import pytest

from tests.cli import run_cli


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_din_cli_with_a_rank_of_padding_at_the_epoch_end_finishes(tmp_path):
    """The user's command, smaller: 800 training rows, global batch 128, so the epoch's last
    batch holds 32 real rows, all on rank 0."""
    res = run_cli(
        [
            "train",
            "--config",
            "configs/movielens_din.yaml",
            "--run-dir",
            tmp_path / "run",
            "data.split={by: position, fractions: [0.8, 0.1, 0.1]}",
            "data.num_rows=1000",
            "train.epochs=1",
            "train.progress_bar=false",
            "checkpoint.enabled=false",
            "checkpoint.keep_best=false",
            "train.pipeline=sparse_dist",
        ],
        tmp_path,
        timeout=150,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained 800 samples in 7 steps on 2 ranks" in res.stdout, res.stdout
