"""DIN over a sequence feature: the attention of eq. 3 against a plain loop, empty histories."""

import torch
from torchrec import KeyedJaggedTensor

from recsys_dist.data.spec import FeatureSpec, make_sequence_tables, make_tables
from recsys_dist.models.registry import get_model
from recsys_dist.models.zoo.din import DINConfig


def spec():
    return FeatureSpec(
        dense_names=[],
        sparse_names=["user", "movie"],
        tables=make_tables(["user", "movie"], [10, 20], 8),
        embedding_device=torch.device("cpu"),
        sequence_names=["history"],
        sequence_tables=make_sequence_tables(["history"], [20], 8),
    )


def batch():
    # rows: history [3, 4, 5], [] (empty), [7]
    return KeyedJaggedTensor(
        keys=["user", "movie", "history"],
        values=torch.tensor([1, 2, 3, 9, 8, 7, 3, 4, 5, 7]),
        lengths=torch.tensor([1, 1, 1, 1, 1, 1, 3, 0, 1]),
    )


def build():
    cfg = DINConfig(target_feature="movie", embedding_dim=8, deep_layer_sizes=[8])
    torch.manual_seed(0)
    return get_model("din").build(spec(), cfg)


def test_din_attention_matches_a_plain_loop():
    model = build().eval()
    kjt = batch()
    logits = model(torch.zeros(3, 0), kjt)
    assert logits.shape == (3, 1)
    pooled = model.sparse_arch(kjt).to_dict()
    target = pooled["movie"]
    seq = model.seq_arch(kjt)["history"]
    att = model.attention[0]
    interests = []
    for b, ids in enumerate(seq.to_dense()):
        v = torch.zeros(8)
        for e in ids:  # eq. 3: sum_j a(e_j, v_A) e_j, no softmax
            t = target[b]
            v = v + att(torch.cat([e, t, e - t, e * t]))[0] * e
        interests.append(v)
    x = torch.cat([pooled["user"], pooled["movie"], torch.stack(interests)], dim=1)
    torch.testing.assert_close(logits, model.deep(x), rtol=0, atol=1e-6)
    assert torch.equal(torch.stack(interests)[1], torch.zeros(8))  # the empty history


def test_din_reads_the_history_order_free_but_content_sensitive():
    model = build().eval()
    kjt = batch()
    other = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().clone(), lengths=kjt.lengths())
    other.values()[6] = 11  # another movie in row 0's history
    a, b = model(torch.zeros(3, 0), kjt), model(torch.zeros(3, 0), other)
    assert not torch.allclose(a[0], b[0]) and torch.equal(a[1:], b[1:])
