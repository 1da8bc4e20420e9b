"""Metrics against scikit-learn in one process: exact path, GAUC, streaming histogram."""

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, log_loss, roc_auc_score

from recsys_dist.train.metrics import (
    StreamingBinaryMetrics,
    auc,
    binary_metrics,
    gather_predictions,
    group_auc,
)


def _sk_ne(labels, probs):
    c = labels.mean()
    return log_loss(labels, probs) / -(c * np.log(c) + (1 - c) * np.log(1 - c))


def _sk_gauc(labels, scores, groups):
    num = den = 0.0
    for g in np.unique(groups):
        m = groups == g
        if 0 < labels[m].sum() < m.sum():
            num += m.sum() * roc_auc_score(labels[m], scores[m])
            den += m.sum()
    return num / den


def _data(seed, n=2000, ties=300):
    g = np.random.default_rng(seed)
    labels = (g.random(n) < 0.25).astype(np.float64)
    logits = g.normal(size=n) + labels
    logits[:ties] = np.round(logits[:ties])  # many ties
    return labels, logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_metrics_match_sklearn(seed):
    labels, logits = _data(seed)
    m = binary_metrics(torch.tensor(logits), torch.tensor(labels))
    probs = 1 / (1 + np.exp(-logits))
    assert m["auc"] == pytest.approx(roc_auc_score(labels, logits), abs=1e-12)
    assert m["logloss"] == pytest.approx(log_loss(labels, probs), rel=1e-9)
    assert m["ne"] == pytest.approx(_sk_ne(labels, probs), rel=1e-9)
    assert m["calibration"] == pytest.approx(probs.mean() / labels.mean(), rel=1e-12)
    assert m["accuracy"] == pytest.approx(accuracy_score(labels, probs > 0.5), abs=1e-15)
    assert m["num_examples"] == 2000
    assert "gauc" not in m


@pytest.mark.parametrize("seed", [0, 1])
def test_gauc_matches_per_group_sklearn(seed):
    labels, logits = _data(seed)
    g = np.random.default_rng(seed + 100)
    # 0..59 with a skew so group sizes differ; huge ids check nothing is cast to float.
    groups = (g.zipf(1.5, size=labels.size) % 60).astype(np.int64) + (1 << 40)
    groups[:5] = 7  # a one-class group of its own (labels forced below)
    labels[groups == 7] = 1.0
    gauc, n_groups = group_auc(torch.tensor(logits), torch.tensor(labels), torch.tensor(groups))
    assert gauc == pytest.approx(_sk_gauc(labels, logits, groups), abs=1e-12)
    both = sum(0 < labels[groups == k].sum() < (groups == k).sum() for k in np.unique(groups))
    assert n_groups == both
    m = binary_metrics(torch.tensor(logits), torch.tensor(labels), groups=torch.tensor(groups))
    assert m["gauc"] == gauc and m["gauc_num_groups"] == n_groups


def test_gauc_one_group_equals_auc_and_no_valid_group_is_nan():
    labels, logits = _data(3, n=500)
    one = torch.zeros(500, dtype=torch.long)
    assert group_auc(torch.tensor(logits), torch.tensor(labels), one)[0] == pytest.approx(
        roc_auc_score(labels, logits), abs=1e-12
    )
    gauc, n = group_auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 0.0]), torch.tensor([1, 2]))
    assert np.isnan(gauc) and n == 0


def test_auc_single_class_is_nan():
    assert np.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])))
    s = StreamingBinaryMetrics(16)
    s.update(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0]))
    m = s.compute()
    assert np.isnan(m["auc"]) and np.isnan(m["auc_error_bound"]) and np.isnan(m["ne"])


def test_gather_drops_padding_without_process_group():
    lg, lb = gather_predictions(
        torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])
    )
    assert lg.tolist() == [1.0, 2.0] and lb.tolist() == [0.0, 1.0]
    big = (1 << 40) + 3
    _, _, gr = gather_predictions(
        torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]), groups=torch.tensor([5, big])
    )
    assert gr.dtype == torch.int64 and gr.tolist() == [big]


def _streaming(logits, labels, weights=None, buckets=1 << 16, batch=777):
    s = StreamingBinaryMetrics(buckets)
    for i in range(0, len(labels), batch):
        w = None if weights is None else torch.tensor(weights[i : i + batch])
        s.update(torch.tensor(logits[i : i + batch]), torch.tensor(labels[i : i + batch]), w)
    return s.merge().compute()  # no process group: merge is a copy


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_matches_sklearn_and_padding_is_ignored(seed):
    labels, logits = _data(seed)
    probs = 1 / (1 + np.exp(-logits))
    # Padding rows interleaved: weight 0, label 1, extreme logits; they must change nothing.
    pad = np.arange(0, 2000, 7)
    all_logits = np.insert(logits, pad, 30.0)
    all_labels = np.insert(labels, pad, 1.0)
    weights = np.insert(np.ones_like(labels), pad, 0.0)
    m = _streaming(all_logits, all_labels, weights)
    exact = roc_auc_score(labels, logits)
    assert abs(m["auc"] - exact) <= m["auc_error_bound"]
    assert m["logloss"] == pytest.approx(log_loss(labels, probs), rel=1e-12)
    assert m["ne"] == pytest.approx(_sk_ne(labels, probs), rel=1e-12)
    assert m["calibration"] == pytest.approx(probs.mean() / labels.mean(), rel=1e-12)
    assert m["accuracy"] == pytest.approx(accuracy_score(labels, probs > 0.5), abs=1e-15)
    assert m["num_examples"] == 2000
    assert set(binary_metrics(torch.tensor(logits), torch.tensor(labels))) <= set(m)


@pytest.mark.parametrize("buckets", [2, 16, 1000])
def test_streaming_bound_holds_with_coarse_buckets(buckets):
    """Few buckets: many same-bucket pairs, a large bound, and it must still hold."""
    for seed in range(5):
        labels, logits = _data(seed, n=3000, ties=0)
        m = _streaming(logits, labels, buckets=buckets)
        exact = roc_auc_score(labels, logits)
        assert abs(m["auc"] - exact) <= m["auc_error_bound"] + 1e-15
        assert m["auc_error_bound"] <= 0.5
    # Two buckets with all positives in one and all negatives in the other: exact.
    s = StreamingBinaryMetrics(2)
    s.update(torch.tensor([-3.0, -2.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert s.compute()["auc"] == 1.0 and s.compute()["auc_error_bound"] == 0.0


def test_streaming_bound_is_small_at_1e5_examples():
    g = np.random.default_rng(42)
    n = 100_000
    labels = (g.random(n) < 0.25).astype(np.float64)
    logits = g.normal(size=n) * 1.5 + labels - 1.0
    m = _streaming(logits, labels, batch=8192)
    exact = roc_auc_score(labels, logits)
    assert abs(m["auc"] - exact) <= m["auc_error_bound"]
    assert m["auc_error_bound"] < 1e-3
    print(f"\n1e5 rows, 2^16 buckets: |hist - exact| = {abs(m['auc'] - exact):.2e}, bound = {m['auc_error_bound']:.2e}")


def test_streaming_state_is_fixed_size_and_rejects_bad_input():
    s = StreamingBinaryMetrics(1024)
    size = s.state.numel()
    s.update(torch.randn(50_000), (torch.rand(50_000) < 0.3).float())
    assert s.state.numel() == size == 2 * 1024 + 5
    with pytest.raises(ValueError, match="must match"):
        s.update(torch.randn(3), torch.ones(4))
    with pytest.raises(ValueError, match="num_buckets"):
        StreamingBinaryMetrics(1)
    merged = s.merge()
    assert merged is not s and torch.equal(merged.state, s.state)
    s.reset()
    assert s.compute()["num_examples"] == 0


def test_predictions_are_written_as_csv_or_parquet_by_the_file_name(tmp_path):
    import numpy as np
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from recsys_dist.serve.export import write_predictions

    scores = {"logit": np.array([0.0, 2.0], np.float32), "label": np.array([1.0, np.nan])}
    write_predictions(scores, tmp_path / "p.csv")
    write_predictions(scores, tmp_path / "p.parquet")
    for t in (pacsv.read_csv(tmp_path / "p.csv"), pq.read_table(tmp_path / "p.parquet")):
        assert t.column("row").to_pylist() == [0, 1] and t.column("label").to_pylist() == [1.0, None]
        assert t.column("probability").to_pylist()[0] == 0.5
