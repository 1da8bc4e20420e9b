"""two_tower in one process: the in-batch softmax loss against a plain loop, recall@K / NDCG@K
against a brute-force ranking, the model's outputs through CTRTask, and the config checks."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.data.loader import CTRBatch
from recsys_dist.models.build import build_model
from recsys_dist.models.losses import in_batch_softmax
from recsys_dist.models.retrieval import rank_metrics
from recsys_dist.train.preflight import check_sections, section_problems
from tests.conftest import ROOT

CONFIG = ROOT / "configs" / "movielens_two_tower.yaml"


def _job(path, overrides):
    return resolve_job(load_config(path, overrides))


def loop_loss(scores, ids, log_q, weights, labels, positives_only):
    """Yi et al. eq. 3-4 with a Python loop over rows and candidates."""
    total, norm = 0.0, 0.0
    B = len(ids)
    for i in range(B):
        r = weights[i] * (labels[i] if positives_only else 1.0)
        if r == 0:
            continue
        terms = [scores[i, j] - log_q[j] for j in range(B) if j == i or (weights[j] > 0 and ids[j] != ids[i])]
        log_p = (scores[i, i] - log_q[i]) - math.log(sum(math.exp(t) for t in terms))
        total += -r * log_p
        norm += r
    return total / max(norm, 1.0)


@pytest.mark.parametrize("positives_only", [False, True])
def test_in_batch_softmax_matches_a_loop_with_logq_repeats_and_padding(positives_only):
    g = torch.Generator().manual_seed(0)
    B = 9
    scores = torch.randn(B, B, generator=g, dtype=torch.float64)
    ids = torch.tensor([5, 3, 5, 7, 2, 3, 9, 9, 9])  # repeats: accidental hits; last two rows padding
    log_q = torch.log(torch.rand(B, generator=g, dtype=torch.float64))
    weights = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.float64)
    labels = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 1], dtype=torch.float64)
    got = in_batch_softmax(scores[:, 0], labels, weights, scores, ids, log_q, positives_only=positives_only)
    want = loop_loss(scores.numpy(), ids.tolist(), log_q.numpy(), weights.tolist(), labels.tolist(), positives_only)
    assert float(got) == pytest.approx(want, rel=1e-6)


def test_in_batch_softmax_of_padding_only_is_zero_with_zero_gradients():
    scores = torch.randn(4, 4, requires_grad=True)
    loss = in_batch_softmax(
        scores[:, 0], torch.ones(4), torch.zeros(4), scores, torch.tensor([1, 1, 1, 1]), torch.zeros(4)
    )
    loss.backward()
    assert float(loss) == 0 and torch.equal(scores.grad, torch.zeros(4, 4))


def brute_force(scores, corpus, positives, seen, k):
    recalls, ndcgs = [], []
    for s_u, p, sn in zip(scores, positives, seen):
        seen_set, pos_set = set(sn.tolist()), set(p.tolist())
        cand = sorted((-float(s_u[j]), int(c)) for j, c in enumerate(corpus) if c not in seen_set)
        top = [c for _, c in cand[:k]]
        hits = [c in pos_set for c in top]
        recalls.append(sum(hits) / len(p))
        idcg = sum(1 / np.log2(r + 2) for r in range(min(k, len(p))))
        ndcgs.append(sum(h / np.log2(r + 2) for r, h in enumerate(hits)) / idcg)
    return np.mean(recalls), np.mean(ndcgs)


def test_rank_metrics_match_a_brute_force_ranking_with_ties_seen_items_and_misses():
    rng = np.random.default_rng(0)
    corpus = np.sort(rng.choice(np.arange(2, 200), size=60, replace=False))
    U = 25
    scores = rng.integers(0, 6, size=(U, len(corpus))).astype(np.float64)  # many ties: to the lower id
    positives, seen = [], []
    for _ in range(U):
        seen.append(rng.choice(corpus, size=rng.integers(0, 10), replace=False))
        p = rng.choice(np.setdiff1d(corpus, seen[-1]), size=rng.integers(1, 8), replace=False)
        positives.append(np.concatenate([p, [1] * int(rng.integers(0, 2))]))  # an out-of-corpus miss
    got = rank_metrics(torch.as_tensor(scores), corpus, positives, seen, [3, 10, 70])
    for k in (3, 10, 70):
        recall, ndcg = brute_force(scores, corpus, positives, seen, k)
        assert got[f"recall@{k}"] == pytest.approx(recall, abs=1e-12)
        assert got[f"ndcg@{k}"] == pytest.approx(ndcg, abs=1e-12)


def test_two_tower_outputs_through_ctr_task_and_counts_give_logq():
    job = resolve_job(load_config(CONFIG, ["distributed.nproc_per_node=1"]), sizes=[20, 30, 10])
    counts = np.arange(30, dtype=np.int64)
    spec = dataclasses.replace(job.features.on(torch.device("cpu")), id_counts={"movieId": counts})
    task = build_model(job.model, spec, job.train)
    m = task.model
    assert torch.allclose(
        m.log_q.log_q, torch.log(torch.tensor(np.maximum(counts, 1) / counts.sum(), dtype=torch.float32))
    )
    # 3 rows: users 2, 3, 4; movies 5, 6, 6; genres [1, 2], [3], []
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["userId", "movieId", "genres"],
        torch.tensor([2, 3, 4, 5, 6, 6, 1, 2, 3]),
        torch.tensor([1, 1, 1, 1, 1, 1, 2, 1, 0], dtype=torch.int32),
    )
    out = m(torch.zeros(3, 0), kjt)
    u, v = m.user_vectors(kjt), m.item_vectors(kjt)
    assert torch.allclose(out["candidate_scores"], u @ v.T / 0.1, atol=1e-5)
    assert torch.allclose(out["logits"], (u * v).sum(1) / 0.1, atol=1e-5)
    assert torch.equal(out["candidate_ids"], torch.tensor([5, 6, 6]))
    assert torch.allclose(out["candidate_log_q"], m.log_q.log_q[[5, 6, 6]])
    assert torch.allclose(u.norm(dim=1), torch.ones(3)) and torch.allclose(v.norm(dim=1), torch.ones(3))
    # CTRTask: logits for the metrics, the other entries into the loss.
    labels, weights = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 0.0])
    loss, (_, logits, _, _) = task(CTRBatch(torch.zeros(3, 0), kjt, labels, weights))
    want = in_batch_softmax(
        out["logits"], labels, weights, out["candidate_scores"], out["candidate_ids"], out["candidate_log_q"]
    )
    assert torch.allclose(logits, out["logits"]) and torch.allclose(loss, want)


def test_two_tower_config_problems():
    assert section_problems(_job(CONFIG, [])) == []
    with pytest.raises(ConfigError, match="train.loss"):
        check_sections(_job(CONFIG, ["train.loss=bce"]))
    with pytest.raises(ConfigError, match="model.item_id"):
        check_sections(_job(CONFIG, ["model.item_id=genres"]))
    with pytest.raises(ConfigError, match="eval.retrieval_k"):
        check_sections(_job(ROOT / "configs" / "movielens_deepfm.yaml", ["eval.retrieval_k=[10]"]))
    with pytest.raises(ConfigError, match="data.categorical_mapping"):
        check_sections(_job(CONFIG, ["data.categorical_mapping=managed", "data.managed.eviction_interval=10"]))
    with pytest.raises(ConfigError, match="candidate_scores"):
        check_sections(_job(CONFIG, ["train.loss_args.candidate_scores=1"]))
    # per-feature managed tables: the item id (or the user) would reach evaluation as raw keys
    managed = ["data.managed.eviction_interval=10", "data.managed.features=[movieId]"]
    with pytest.raises(ConfigError, match=r"data.managed.features: 'movieId' \(model.item_id\) is managed"):
        check_sections(_job(CONFIG, managed))
    other = [f for f in load_config(CONFIG, []).model.item_features if f != "movieId"]
    if other:  # a managed item feature besides the id is fine
        assert section_problems(_job(CONFIG, [managed[0], f"data.managed.features=[{other[0]}]"])) == []


def test_in_batch_softmax_is_a_weighted_mean_also_below_one():
    """Sample weights that sum below 1 (0.1 each) give the same mean as weights of 1."""
    g = torch.Generator().manual_seed(0)
    scores, ids = torch.randn(4, 4, generator=g), torch.arange(4)
    labels, log_q = torch.ones(4), torch.zeros(4)
    args = dict(candidate_scores=scores, candidate_ids=ids, candidate_log_q=log_q)
    ones = in_batch_softmax(scores.diagonal(), labels, torch.ones(4), **args)
    quarter = in_batch_softmax(scores.diagonal(), labels, torch.full((4,), 0.1), **args)
    assert torch.allclose(ones, quarter, atol=1e-6), (ones, quarter)
