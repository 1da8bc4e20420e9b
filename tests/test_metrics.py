import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from recsys_dist.metrics import auc, binary_metrics, gather_predictions


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_and_logloss_match_sklearn(seed):
    g = np.random.default_rng(seed)
    labels = (g.random(2000) < 0.25).astype(np.float64)
    logits = g.normal(size=2000) + labels
    logits[:300] = np.round(logits[:300])  # many ties
    m = binary_metrics(torch.tensor(logits), torch.tensor(labels))
    assert m["auc"] == pytest.approx(roc_auc_score(labels, logits), abs=1e-12)
    probs = 1 / (1 + np.exp(-logits))
    assert m["logloss"] == pytest.approx(log_loss(labels, probs), rel=1e-9)
    c = labels.mean()
    assert m["ne"] == pytest.approx(log_loss(labels, probs) / -(c * np.log(c) + (1 - c) * np.log(1 - c)))
    assert m["num_examples"] == 2000


def test_auc_single_class_is_nan():
    assert np.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])))


def test_gather_drops_padding_without_process_group():
    lg, lb = gather_predictions(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0]))
    assert lg.tolist() == [1.0, 2.0] and lb.tolist() == [0.0, 1.0]
