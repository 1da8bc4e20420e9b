"""A mid-epoch validation under ``train.pipeline: sparse_dist`` with a sharded EmbeddingCollection
(DIN's and BST's history) on 2 ranks: training continues to the metrics of ``base`` (the
reference; both pipelines are synchronous, so bit for bit). Before the fix the first step
after the validation of step 10 failed with gloo ``alltoall.cc:30 in->size == out->size``:
TorchRec's ``attach`` (which ``progress`` calls after ``detach``) started the in-flight
batch's input_dist again, giving it a fresh module context, from which the EmbeddingCollection's
output_dist read its all-to-all sizes (recsys_dist.train.observe.TimedTrainPipeline.attach).

A callback's ``trainer.evaluate`` between validations scores as base does. Before the fix it
ran the forward the pipeline had rewritten: a shape error with DIN/BST (the training batch's
embeddings for an eval batch), TorchRec's "input_dist ... not available" with DeepFM."""

import pytest

from recsys_dist.testing import run_ranks
from tests.ranks.train.pipeline_eval_worker import train_both_pipelines


def numbers(records: list[dict]) -> list[tuple]:
    """(split, step, loss / auc / logloss) of every record but the timings."""
    keys = ("loss", "auc", "logloss", "ne", "calibration", "accuracy", "num_examples")
    return [
        (r["split"], r.get("step"), *(r.get(k) for k in keys))
        for r in records
        if r["split"] in ("train", "validation", "test")
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sparse_dist_with_mid_epoch_validation_and_callback_evaluate_equals_base(tmp_path):
    runs = run_ranks(train_both_pipelines, 2, str(tmp_path / "cache"), str(tmp_path), timeout_s=800)[0]
    for model in ("din", "bst", "deepfm"):
        (want, want_cb), (got, got_cb) = runs[f"{model}-base"], runs[f"{model}-sparse_dist"]
        want, got = numbers(want), numbers(got)
        assert [(s, step) for s, step, *_ in want if s == "validation"] == [("validation", n) for n in (10, 20, 30)]
        assert [s for s, *_ in want].count("test") == 1 and [s for s, *_ in want].count("train") == 6
        assert got == want, model
        # the callback's evaluate between validations (step 15): every validation row, as base scores them
        assert want_cb["num_examples"] == next(r[-1] for r in want if r[0] == "validation"), model
        assert got_cb == want_cb, model
