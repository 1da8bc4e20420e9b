"""HSTU over a sequence feature: the layers of eq. 1-3 against a plain per-row computation over
the real tokens only (so padding is proven masked), padding and batch invariance, the causal
mask, the position buckets, several tasks, the pipeline's tracer."""

import pytest
import torch
from torch.nn import functional as F
from torchrec import KeyedJaggedTensor

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from recsys_dist.data.spec import FeatureSpec, make_sequence_tables, make_tables
from recsys_dist.models import hstu_attention
from recsys_dist.models.registry import get_model
from recsys_dist.models.sequence import padded_sequence
from recsys_dist.models.zoo.hstu import HSTUConfig, position_bucket, target_layout
from tests.conftest import ROOT

E, HEADS, DQK, DV = 8, 2, 4, 3


def spec(tasks=("label",)):
    return FeatureSpec(
        dense_names=["d"],
        sparse_names=["user", "movie"],
        tables=make_tables(["user", "movie"], [10, 20], E),
        embedding_device=torch.device("cpu"),
        sequence_names=["history"],
        sequence_tables=make_sequence_tables(["history"], [20], E),
        tasks=list(tasks),
    )


def kjt_of(rows):
    """rows: [(user, movie, [history ids])] -> the KeyedJaggedTensor of the batch."""
    values = [r[0] for r in rows] + [r[1] for r in rows] + [h for r in rows for h in r[2]]
    lengths = [1] * (2 * len(rows)) + [len(r[2]) for r in rows]
    return KeyedJaggedTensor(
        keys=["user", "movie", "history"], values=torch.tensor(values), lengths=torch.tensor(lengths)
    )


ROWS = [(1, 9, [3, 4, 5, 6]), (2, 8, []), (3, 7, [7])]


def batch():
    return kjt_of(ROWS)


def build(tasks=("label",), **kw):
    cfg = HSTUConfig(
        target_feature="movie",
        embedding_dim=E,
        deep_layer_sizes=[8],
        num_heads=HEADS,
        attention_dim=DQK,
        linear_dim=DV,
        layer_dropout=0.0,
        **kw,
    )
    torch.manual_seed(0)
    model = get_model("hstu").build(spec(tasks), cfg)
    with torch.no_grad():  # embeddings of norm ~1 (not 0.05), so a wrong attention moves the outputs well past rounding
        for p in [*model.sparse_arch.parameters(), *model.seq_arch.parameters()]:
            p.uniform_(-1, 1)
    return model


def layer_reference(layer, x, positions, num_buckets):
    """One HSTU layer (eq. 1-3) over the real tokens x [n, E] of one row, every token real,
    ``positions`` [n] their positions: loops over heads and queries, no mask tensor."""
    norm = F.layer_norm(x, (E,), eps=1e-6)
    uvqk = F.silu(norm @ layer.f1.weight.T)
    u, v, q, k = uvqk.split([HEADS * DV, HEADS * DV, HEADS * DQK, HEADS * DQK], dim=1)
    out = torch.zeros(len(x), HEADS * DV)
    for h in range(HEADS):
        qh, kh, vh = q[:, h * DQK : (h + 1) * DQK], k[:, h * DQK : (h + 1) * DQK], v[:, h * DV : (h + 1) * DV]
        for i in range(len(x)):
            keys = range(i + 1)  # causal: tokens 0..i
            d = torch.tensor([positions[i] - positions[j] for j in keys])
            rab = layer.position_bias[position_bucket(d, num_buckets)]
            w = F.silu(qh[i] @ kh[: i + 1].T + rab) / (i + 1)
            out[i, h * DV : (h + 1) * DV] = w @ vh[: i + 1]
    return x + layer.f2(F.layer_norm(out, (HEADS * DV,), eps=1e-6) * u)


@pytest.mark.parametrize("kernel", ["dense", "chunked"])
@pytest.mark.parametrize("max_positions", [64, 4])
def test_hstu_matches_a_plain_per_row_computation(max_positions, kernel, monkeypatch):
    """The outputs and every layer's gradients, for each attention kernel (chunks of 2 query
    rows: the 5 tokens of the longest row in 3 chunks, the last one short)."""
    monkeypatch.setattr(hstu_attention, "CHUNK_QUERIES", 2)
    model = build(num_layers=2, max_positions=max_positions, attention=kernel).eval()
    kjt, dense = batch(), torch.randn(3, 1)
    logits = model(dense, kjt)
    assert logits.shape == (3, 1)
    pooled = model.sparse_arch(kjt).to_dict()
    seq = model.seq_arch(kjt)["history"]
    feats = []
    for b, h in enumerate(seq.to_dense()):
        x = torch.cat([h, pooled["movie"][b : b + 1]])  # h_1..h_n, then the target
        positions = list(range(len(x)))  # the target right after the last event
        for layer in model.stacks[0]:
            x = layer_reference(layer, x, positions, max_positions)
        feats.append(x[-1])
    # the target's outputs themselves (the head's MLP would shrink a difference), then the logits
    values, mask = padded_sequence(model.seq_arch(kjt), "history")
    got = model.summarise(0, values, mask, pooled["movie"])
    torch.testing.assert_close(got, torch.stack(feats), rtol=0, atol=1e-5)
    x = torch.cat([dense, pooled["user"], pooled["movie"], torch.stack(feats)], dim=1)
    torch.testing.assert_close(logits, model.deep(x), rtol=0, atol=1e-5)
    # gradients of the layers' weights (the chunked kernel recomputes its scores in backward)
    params = list(model.stacks[0].parameters())
    probe = torch.randn_like(got)
    want = torch.autograd.grad((torch.stack(feats) * probe).sum(), params, retain_graph=True)
    for g, w in zip(torch.autograd.grad((got * probe).sum(), params), want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_a_rows_logit_does_not_depend_on_padding_or_the_other_rows():
    model = build().eval()
    dense = torch.randn(3, 1)
    base = model(dense, batch())
    # a longer history in another row pads rows 0 and 2 further; a reordered batch; a row alone
    longer = [ROWS[0], (2, 8, list(range(1, 12))), ROWS[2]]
    torch.testing.assert_close(model(dense, kjt_of(longer))[[0, 2]], base[[0, 2]], rtol=0, atol=1e-6)
    swapped = model(dense[[2, 0, 1]], kjt_of([ROWS[2], ROWS[0], ROWS[1]]))
    torch.testing.assert_close(swapped, base[[2, 0, 1]], rtol=0, atol=1e-6)
    for b in range(3):
        torch.testing.assert_close(model(dense[b : b + 1], kjt_of([ROWS[b]])), base[b : b + 1], rtol=0, atol=1e-6)


def test_causal_mask_later_tokens_never_change_earlier_outputs():
    model = build(num_layers=3).eval()
    torch.manual_seed(1)
    stack = model.stacks[0]
    values, target = torch.randn(1, 6, E), torch.randn(1, E)
    mask = torch.ones(1, 6)

    def outputs(values, target):
        weight, hb, tb = target_layout(mask, model.max_positions)
        x = torch.cat([values, target.unsqueeze(1)], dim=1)
        for layer in stack:
            x = layer(x, weight, hb, tb)
        return x

    base = outputs(values, target)
    later = values.clone()
    later[0, 4:] = torch.randn(2, E)  # events 5 and 6 changed: outputs 1-4 stay, 5, 6 and the target move
    got = outputs(later, target)
    torch.testing.assert_close(got[0, :4], base[0, :4], rtol=0, atol=0)
    assert not torch.allclose(got[0, 4:], base[0, 4:])
    other_target = outputs(values, torch.randn(1, E))  # the target is last: it changes only itself
    torch.testing.assert_close(other_target[0, :6], base[0, :6], rtol=0, atol=0)
    assert not torch.allclose(other_target[0, 6], base[0, 6])


def test_hstu_reads_the_history_order_and_content():
    model = build().eval()
    kjt, dense = batch(), torch.zeros(3, 1)
    base = model(dense, kjt)
    for i, new in ((6, 11), (7, 3)):  # another movie in row 0's history; the order swapped
        v = kjt.values().clone()
        v[i] = new
        other = model(dense, KeyedJaggedTensor(keys=kjt.keys(), values=v, lengths=kjt.lengths()))
        assert not torch.allclose(base[0], other[0]) and torch.equal(base[1:], other[1:])


def test_position_buckets_exact_then_logarithmic():
    d = torch.tensor([0, 1, 31, 32, 40, 63, 64, 128, 5000, 8192, 10**6])
    assert position_bucket(d, 64).tolist() == [0, 1, 31, 32, 33, 35, 36, 40, 61, 63, 63]
    assert position_bucket(torch.arange(6), 2).tolist() == [0, 1, 1, 1, 1, 1]
    # the target's distance to each history event counts from its real length, not the padding
    _, hb, tb = target_layout(torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]]), 64)
    assert tb.tolist() == [[2, 1, 0, 0, 0], [4, 3, 2, 1, 0]] and hb[3].tolist() == [3, 2, 1, 0, 0]


def test_several_tasks_give_one_logit_column_each():
    model = build(tasks=("click", "like", "rating")).eval()
    logits = model(torch.randn(3, 1), batch())
    assert logits.shape == (3, 3)
    assert len(model.deep.heads) == 3 and not torch.allclose(logits[:, 0], logits[:, 1])


def test_every_parameter_gets_a_gradient_also_for_empty_histories():
    model = build().train()
    model(torch.randn(3, 1), batch()).sum().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, no_grad
    empty = kjt_of([(1, 2, []), (3, 4, [])])
    out = model(torch.zeros(2, 1), empty)
    assert out.shape == (2, 1) and torch.isfinite(out).all()


def test_hstu_traces_with_torchrecs_pipeline_tracer():
    """TrainPipelineSparseDist traces the model with this tracer (the sharded collections are its
    leaves): the traced graph gives the model's logits."""
    from torch.fx import GraphModule
    from torchrec.distributed.train_pipeline.tracing import Tracer

    model = build().eval()
    graph = Tracer(leaf_modules=["sparse_arch", "seq_arch"]).trace(model)
    traced = GraphModule(model, graph)
    for kjt in (batch(), kjt_of([(1, 2, list(range(1, 9)))])):
        dense = torch.randn(kjt.stride(), 1)
        torch.testing.assert_close(traced(dense, kjt), model(dense, kjt), rtol=0, atol=0)


def test_hstu_config_ships_and_refuses_what_it_does_not_take():
    cfg = ROOT / "configs" / "movielens_hstu.yaml"
    loaded = load_config(cfg)
    assert loaded.model.name == "hstu" and loaded.model.num_layers == 2
    with pytest.raises(ConfigError, match=r"model\.transformer_dropout"):
        load_config(cfg, ["model.transformer_dropout=0.1"])
    with pytest.raises(ConfigError, match=r"model\.max_positions"):
        load_config(cfg, ["model.max_positions=1"])
