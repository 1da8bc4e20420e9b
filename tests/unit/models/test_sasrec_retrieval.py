"""The SASRec baseline encoder (recsys_dist/models/sasrec_retrieval.py): against a plain per-row
loop of the reference's block, the user vector of a history equal to the training query that
predicts its next item (positions counted from the first item), padding never read and no NaN,
and a few training steps that learn a sequence rule."""

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torchrec.modules.embedding_modules import EmbeddingCollection

from recsys_dist.models.hstu_retrieval import (
    history_kjt,
    item_table,
    next_item_batch,
)
from recsys_dist.models.sasrec_retrieval import SASRecRetrieval
from tests.unit.models.test_hstu_retrieval import learns_a_sequence_rule


def build(num_items=12, dim=8, dropout=0.2, max_length=10, seed=0):
    torch.manual_seed(seed)
    ec = EmbeddingCollection(tables=[item_table(num_items, dim, init_scale=0.3)], device=torch.device("cpu"))
    return SASRecRetrieval(ec, dim, num_layers=2, num_heads=2, dropout=dropout, max_length=max_length)


def layer_norm(v):
    return (v - v.mean()) / torch.sqrt(v.var(unbiased=False) + 1e-8)


def plain_encode(model, ids):
    """One unpadded sequence by loops: ``e * sqrt(D) + p_i`` (i from the first item), per block
    ``q = LN(x)``, per head softmax over keys 0..i of ``q W_q . x W_k / sqrt(d)``, ``h = LN(q +
    attention)``, ``x = h + FF(h)``; the output L2-normalised. float64."""
    d, table = model.dim, model.seq_arch.embedding_configs()[0]
    emb = model.seq_arch.embeddings[table.name].weight.double()
    x = [emb[j] * math.sqrt(d) + model.positions[i].double() for i, j in enumerate(ids)]
    for block in model.blocks:
        att = block.attention
        heads, hd = att.num_heads, d // att.num_heads
        w_q, w_k, w_v = att.in_proj_weight.double().split(d)
        b_q, b_k, b_v = att.in_proj_bias.double().split(d)
        lin1, lin2 = block.feed_forward[0], block.feed_forward[3]
        out = []
        for i in range(len(x)):
            q = layer_norm(x[i])
            qi = w_q @ q + b_q
            heads_out = []
            for h in range(heads):
                s = slice(h * hd, (h + 1) * hd)
                scores = [float(qi[s] @ (w_k @ x[j] + b_k)[s]) / math.sqrt(hd) for j in range(i + 1)]
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                heads_out.append(sum(w * (w_v @ x[j] + b_v)[s] for j, w in enumerate(weights)))
            a = att.out_proj.weight.double() @ torch.cat(heads_out) + att.out_proj.bias.double()
            h = layer_norm(q + a)
            ff = lin2.weight.double() @ torch.relu(lin1.weight.double() @ h + lin1.bias.double()) + lin2.bias.double()
            out.append(h + ff)
        x = out
    return F.normalize(torch.stack(x), dim=-1)


def test_encoder_equals_a_plain_loop_with_padding():
    model = build().eval()
    seqs = [np.array([3, 4, 5, 6, 1]), np.array([7]), np.array([8, 9, 2])]
    with torch.no_grad():
        out = model(next_item_batch(seqs, 12, 4, np.random.default_rng(0)))
        users = model.user_vectors(history_kjt(seqs))
    # forward's queries: every position with a next item, row-major; the user vector: the last
    expected = torch.cat([plain_encode(model, s)[:-1] for s in seqs]).float()
    torch.testing.assert_close(out["query"], expected, atol=1e-5, rtol=0)
    last = torch.stack([plain_encode(model, s)[-1] for s in seqs]).float()
    torch.testing.assert_close(users, last, atol=1e-5, rtol=0)


def test_user_vector_is_the_training_query_of_its_next_item():
    """Retrieval reads the history's last position; training trains each position to predict the
    next item. The two must be the same vector: with positions counted back from the last item,
    the user vector read position 0, which training never reached (it scored below popularity)."""
    model = build().eval()
    seq = np.array([2, 5, 7, 1, 3, 11])
    with torch.no_grad():
        queries = model(next_item_batch([seq], 12, 4, np.random.default_rng(0)))["query"]
        for n in range(1, len(seq)):
            alone = model.user_vectors(history_kjt([seq[:n]]))
            torch.testing.assert_close(queries[n - 1], alone[0], atol=1e-6, rtol=0)


def test_padding_is_never_read_and_an_empty_row_gives_no_nan():
    model = build().eval()
    short = np.array([2, 5, 7])
    with torch.no_grad():
        alone = model.user_vectors(history_kjt([short]))
        batch = model.user_vectors(history_kjt([np.array([1, 2, 3, 4, 5, 6, 8, 9]), short, np.array([11])]))
        empty = model.user_vectors(history_kjt([np.array([], np.int64), short]))
        other = model.user_vectors(history_kjt([np.array([3, 5, 7])]))
    torch.testing.assert_close(batch[1], alone[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(empty[1], alone[0], atol=1e-6, rtol=0)
    assert torch.isfinite(empty).all()
    assert (other - alone).abs().max() > 1e-3  # the earlier items are read
    with pytest.raises(ValueError, match="max_length=10"):
        model.user_vectors(history_kjt([np.arange(1, 12)]))


def test_position_init_is_the_references():
    model = build(dim=50, max_length=400)
    w = model.positions
    # a normal of std sqrt(1 / D) cut at 2 std: std 0.880 sqrt(1 / D) (the reference's truncated_normal)
    assert float(w.std()) == pytest.approx(0.880 * math.sqrt(1 / 50), rel=0.05)
    assert float(w.abs().max()) <= 2 * math.sqrt(1 / 50) + 1e-6


def test_training_learns_a_sequence_rule():
    """Item i is always followed by i + 1 (mod 12): a few Adam steps must rank the next item first
    (test_hstu_retrieval's check, on the SASRec encoder)."""
    learns_a_sequence_rule(build(num_items=12, dim=16, dropout=0.0), 12)
