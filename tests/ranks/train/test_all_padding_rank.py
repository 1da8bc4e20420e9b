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
collective. DIN, BST and HSTU are also trained on 1 rank: every step's loss and the test metrics
(which follow from the padded step's gradients) must be the 1-rank run's.
"""

import math

import pytest

from recsys_dist.testing import run_ranks
from tests.cli import read_metrics
from tests.ranks.train.all_padding_worker import CASES, train_every_model

COMPARED = ["din", "bst", "hstu"]  # the models whose padding path the fix changed (and HSTU's): also on 1 rank


def step_losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir, "train")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_of_padding_only_never_hangs_any_model(tmp_path):
    cache, out = str(tmp_path / "cache"), str(tmp_path)
    names = [*COMPARED, *(n for n in CASES if n not in COMPARED)]
    two = run_ranks(train_every_model, 2, cache, out, names, timeout_s=600, pg_timeout_s=120)
    one = run_ranks(train_every_model, 1, cache, out, COMPARED, timeout_s=300)
    for name in names:
        summary = two[0][name]
        assert summary["steps"] == 2, name  # 88 rows: a full global batch, then 24 real rows on rank 0
        losses = step_losses(tmp_path / f"{name}-2")
        assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), (name, losses)
    for name in COMPARED:
        ref, got = step_losses(tmp_path / f"{name}-1"), step_losses(tmp_path / f"{name}-2")
        for step in ref:
            assert got[step] == pytest.approx(ref[step], abs=1e-5), (name, step)
        a, b = one[0][name]["test"], two[0][name]["test"]
        for key in ("auc", "logloss"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (name, key)
    # HSTU's chunked attention kernel (recomputed in backward) trains on 2 ranks to the dense kernel's losses
    dense, chunked = step_losses(tmp_path / "hstu-2"), step_losses(tmp_path / "hstu_chunked-2")
    assert chunked == pytest.approx(dense, abs=1e-5)
    for key in ("auc", "logloss"):
        assert two[0]["hstu_chunked"]["test"][key] == pytest.approx(two[0]["hstu"]["test"][key], abs=1e-5)
