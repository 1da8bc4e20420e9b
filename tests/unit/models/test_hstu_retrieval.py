"""HSTU retrieval (next-item) and the leave-last-out protocol: the ranks, top-K, HR/NDCG/MRR
against a plain numpy brute force (ties included), the split, the sampled softmax against a
loop, causality and batch invariance of the user vectors, and a few training steps that learn
a sequence rule. Sharded at 1 vs 2 ranks: tests/ranks/models/test_hstu_retrieval.py."""

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torchrec.modules.embedding_modules import EmbeddingCollection

from recsys_dist.models.hstu_retrieval import (
    HSTURetrieval,
    evaluate_next_item,
    history_kjt,
    item_table,
    next_item_batch,
    sampled_softmax_loss,
)
from recsys_dist.models.next_item import leave_last_out, popular_vectors, ranking_metrics, target_ranks, top_k


def brute_force(users: np.ndarray, items: np.ndarray, targets: np.ndarray, ks, seen=None):
    """Ranks (ids 1..C, ties to the lower id by a stable sort; a user's seen items other than
    the target dropped from the list), top-K lists (seen items last) and the metrics by loops."""
    ranks, tops = [], []
    for i, (u, t) in enumerate(zip(users, targets)):
        scores = items @ u
        order = np.argsort(-scores, kind="stable") + 1
        drop = set() if seen is None else set(seen[i].tolist())
        kept = [j for j in order if j == t or j not in drop]
        ranks.append(kept.index(t) + 1)
        tail = [j for j in order if j in drop]  # by id: they all score -inf
        tops.append(([j for j in order if j not in drop] + sorted(tail))[: max(ks)])
    metrics = {}
    for k in ks:
        metrics[f"hr@{k}"] = sum(r <= k for r in ranks) / len(ranks)
        metrics[f"ndcg@{k}"] = sum(1 / math.log2(r + 1) for r in ranks if r <= k) / len(ranks)
    metrics["mrr"] = sum(1 / r for r in ranks) / len(ranks)
    return ranks, np.array(tops), metrics


@pytest.mark.parametrize("seed,with_seen", [(0, False), (1, False), (2, True), (3, True)])
def test_ranks_and_metrics_equal_brute_force_with_ties(seed, with_seen):
    rng = np.random.default_rng(seed)
    # small integer vectors (exact float products): many items score the same
    users = rng.integers(-2, 3, size=(37, 3)).astype(np.float32)
    items = rng.integers(-2, 3, size=(60, 3)).astype(np.float32)
    targets = rng.integers(1, 61, size=37)
    # seen lists of 0-30 items, the target among them for some users (it must stay a candidate)
    seen = [rng.integers(1, 61, size=int(rng.integers(0, 31))) for _ in range(37)] if with_seen else None
    ks = (1, 5, 10, 50)
    ranks, tops, expected = brute_force(users, items, targets, ks, seen)
    got = target_ranks(torch.tensor(users), torch.tensor(items), targets, seen)
    assert got.tolist() == ranks
    assert torch.equal(top_k(torch.tensor(users), torch.tensor(items), 50, seen), torch.tensor(tops))
    if with_seen:
        assert got.tolist() != target_ranks(torch.tensor(users), torch.tensor(items), targets).tolist()
    metrics = ranking_metrics(got.numpy(), ks)
    assert metrics["users"] == 37
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key


def test_ranks_in_chunks_equal_one_chunk(monkeypatch):
    rng = np.random.default_rng(3)
    users, items = torch.randn(50, 4), torch.randn(30, 4)
    targets = rng.integers(1, 31, size=50)
    whole = target_ranks(users, items, targets)
    monkeypatch.setattr("recsys_dist.models.next_item.USER_CHUNK", 7)
    assert torch.equal(target_ranks(users, items, targets), whole)


def test_ranks_refuse_targets_outside_the_catalogue():
    with pytest.raises(ValueError, match="item ids 1 .. 3"):
        target_ranks(torch.zeros(1, 2), torch.zeros(3, 2), [4])
    with pytest.raises(ValueError, match="do not match"):
        target_ranks(torch.zeros(2, 2), torch.zeros(3, 2), [1])
    with pytest.raises(ValueError, match="2 seen lists for 1 targets"):
        target_ranks(torch.zeros(1, 2), torch.zeros(3, 2), [1], [np.array([1]), np.array([2])])


def test_metric_values_by_hand():
    m = ranking_metrics([1, 2, 11, 60], ks=(10, 50))
    assert m["hr@10"] == 0.5 and m["hr@50"] == 0.75
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3)) / 4)
    assert m["ndcg@50"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(12)) / 4)
    assert m["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 11 + 1 / 60) / 4)


def test_leave_last_out_split():
    # user 7: items 30, 10, 20 at times 1, 2, 2 (tie: input order), 40 at 5; user 8: two events only
    users = [7, 8, 7, 7, 8, 7]
    items = [20, 30, 10, 30, 10, 40]
    times = [2, 1, 2, 1, 2, 5]
    s = leave_last_out(users, items, times)
    assert s.items.tolist() == [10, 20, 30, 40]  # dense ids 1..4
    assert s.users.tolist() == [7] and s.dropped_users == 1
    # by time: 30 (t1), then 20 and 10 (t2, input order), then 40 (t5)
    assert [t.tolist() for t in s.train] == [[3, 2]]
    assert s.validation.tolist() == [1] and s.test.tolist() == [4]
    assert [h.tolist() for h in s.histories("validation", 10)] == [[3, 2]]
    assert [h.tolist() for h in s.histories("test", 2)] == [[2, 1]]  # last 2 of [3, 2, 1]
    with pytest.raises(ValueError, match="no user has 3"):
        leave_last_out([1, 1], [1, 2], [0, 1])


def test_popular_baseline_ranks_by_training_counts():
    users, items = popular_vectors([np.array([2, 2, 3]), np.array([3, 2])], num_items=4)
    # counts: item 2 x3, item 3 x2, items 1 and 4 x0 (tie: 1 before 4)
    assert target_ranks(users, items, [2, 3]).tolist() == [1, 2]
    assert target_ranks(users, items, [4, 1]).tolist() == [4, 3]


def build(num_items=12, dim=8, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    ec = EmbeddingCollection(tables=[item_table(num_items, dim, init_scale=0.5)], device=torch.device("cpu"))
    return HSTURetrieval(ec, dim, num_layers=2, num_heads=2, attention_dim=4, linear_dim=4, dropout=dropout)


def test_sampled_softmax_equals_a_loop():
    torch.manual_seed(1)
    q, p, n = F.normalize(torch.randn(5, 4), dim=1), F.normalize(torch.randn(5, 4), dim=1), torch.randn(3, 4)
    pos_ids, neg_ids = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 9, 4])
    out = {"query": q, "positive": p, "positive_ids": pos_ids, "negatives": n, "negative_ids": neg_ids}
    expected = 0.0
    for i in range(5):
        logits = [float(q[i] @ p[i]) / 0.05] + [
            float(q[i] @ n[j]) / 0.05 for j in range(3) if int(neg_ids[j]) != int(pos_ids[i])
        ]
        expected += -(logits[0] - math.log(sum(math.exp(x) for x in logits)))
    assert float(sampled_softmax_loss(out, 0.05)) == pytest.approx(expected / 5, rel=1e-5)


def test_forward_pairs_each_position_with_its_next_item():
    model = build().eval()
    seqs = [np.array([3, 4, 5, 6]), np.array([7]), np.array([8, 9])]
    out = model(next_item_batch(seqs, 12, 6, np.random.default_rng(0)))
    assert out["positive_ids"].tolist() == [4, 5, 6, 9]  # row 0: 3->4, 4->5, 5->6; row 1 none; row 2: 8->9
    assert out["query"].shape == (4, 8) and out["negatives"].shape == (6, 8)
    assert ((out["negative_ids"] >= 1) & (out["negative_ids"] <= 12)).all()
    # the query of row 0's position 2 is the user vector of its first 3 items (causal)
    alone = model.user_vectors(history_kjt([seqs[0][:3]]))
    torch.testing.assert_close(out["query"][2], alone[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out["positive"][0], F.normalize(model.item_vectors(torch.tensor([4]))[0], dim=0))


def test_user_vectors_do_not_depend_on_later_items_padding_or_batch():
    model = build().eval()
    short = np.array([2, 5, 7])
    alone = model.user_vectors(history_kjt([short]))
    batch = model.user_vectors(history_kjt([np.array([1, 2, 3, 4, 5, 6, 8, 9]), short, np.array([11])]))
    torch.testing.assert_close(batch[1], alone[0], atol=1e-6, rtol=0)
    # position 3's output is the same whatever follows it
    longer = model(history_kjt([np.array([2, 5, 7, 1, 3])], np.array([4])))
    torch.testing.assert_close(longer["query"][2], alone[0], atol=1e-6, rtol=0)
    # and does depend on the earlier items (the attention reads them)
    other = model.user_vectors(history_kjt([np.array([3, 5, 7])]))
    assert (other - alone).abs().max() > 1e-3


def test_evaluate_equals_ranks_of_the_vectors():
    model = build()
    rng = np.random.default_rng(2)
    hist = [rng.integers(1, 13, size=rng.integers(1, 6)) for _ in range(9)]
    targets = rng.integers(1, 13, size=9)
    got = evaluate_next_item(model, hist, targets, 12, batch_size=4, ks=(1, 5))
    model.eval()
    users = torch.cat([model.user_vectors(history_kjt([h])) for h in hist])
    items = model.item_vectors(torch.arange(1, 13))
    expected = ranking_metrics(target_ranks(users, items, targets, hist).numpy(), (1, 5))
    assert got == pytest.approx(expected, abs=1e-12)
    everything = evaluate_next_item(model, hist, targets, 12, batch_size=4, ks=(1, 5), exclude_history=False)
    assert everything == pytest.approx(ranking_metrics(target_ranks(users, items, targets).numpy(), (1, 5)))
    assert everything["mrr"] < got["mrr"]  # the history's items took places above some targets
    with pytest.raises(ValueError, match="none empty"):
        evaluate_next_item(model, [np.array([], np.int64)], np.array([1]), 12)
    with pytest.raises(ValueError, match=r"history 1: item id 13 is outside 1 \.\. 12"):
        evaluate_next_item(model, [np.array([1]), np.array([2, 13])], np.array([1, 2]), 12)
    with pytest.raises(ValueError, match=r"sequence 0: item id 0 is outside"):
        next_item_batch([np.array([0, 1])], 12, 3, np.random.default_rng(0))


def test_training_learns_a_sequence_rule():
    """Item i is always followed by i + 1 (mod 12): a few Adam steps must rank the next item first."""
    learns_a_sequence_rule(build(num_items=12, dim=16, dropout=0.0), 12)


def learns_a_sequence_rule(model, num_items: int) -> None:
    """60 Adam steps of the sampled softmax on "item i is followed by i + 1 (mod num_items)"
    halve the loss and rank the next item first for 90% of the histories (none before);
    shared with the SASRec baseline's test."""
    rng = np.random.default_rng(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def seq(start, n):
        return (start + np.arange(n)) % num_items + 1

    hist = [seq(s, 5) for s in range(num_items)]
    targets = np.array([seq(s, 6)[-1] for s in range(num_items)])
    before = evaluate_next_item(model, hist, targets, num_items, ks=(1,))
    losses = []
    for _ in range(60):
        batch = [seq(int(s), int(n)) for s, n in zip(rng.integers(0, num_items, 16), rng.integers(2, 8, 16))]
        loss = sampled_softmax_loss(model(next_item_batch(batch, num_items, 8, rng)), temperature=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    after = evaluate_next_item(model, hist, targets, num_items, ks=(1,))
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    assert after["hr@1"] >= 0.9 > before["hr@1"]


@pytest.mark.parametrize("key", ["model.time_buckets=8", "model.action_tokens=true"])
def test_hstu_retrieval_refuses_the_ranking_models_time_and_action_keys(key):
    """hstu_retrieval reads no time bias or action tokens: its section has no such keys, so the
    strict config names them (they were accepted and ignored)."""
    from recsys_dist.config.loader import load_config
    from recsys_dist.errors import ConfigError
    from tests.conftest import ROOT

    with pytest.raises(ConfigError, match=key.split("=")[0].split(".")[1]):
        load_config(ROOT / "configs" / "movielens_hstu_retrieval.yaml", [key], check_files=False)
