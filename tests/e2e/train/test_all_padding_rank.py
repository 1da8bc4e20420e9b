"""Issue 30 item 1: every rank runs the same collectives whatever its data, also when its share
of a global batch is padding only (every list feature, so every history, empty).

Before the fix DIN and BST replaced the sequence embeddings of such a batch by zeros made apart
from the graph, so that rank skipped the sharded EmbeddingCollection's backward all-to-all and
the ranks waited in different collectives until the process group's timeout (600 s in a
``recsys-dist train`` run): ``configs/movielens_din.yaml`` with a position split and
``data.num_rows=10000`` (8,000 training rows, 62.5 global batches of 128) hung at the end of its
first epoch.

One spawn of 2 ranks trains every zoo model, the managed-collision path and a user model
(``tests/ranks/train/all_padding_worker.py``: 88 training rows, global batch 64, so rank 1's
share of the second step and of every evaluation batch is padding only) with a process-group
timeout of 120 s: a rank left waiting fails the test in about two minutes, naming the
collective. DIN and BST are also trained on 1 rank: every step's loss and the test metrics
(which follow from the padded step's gradients) must be the 1-rank run's.
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
