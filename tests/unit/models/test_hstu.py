"""HSTU over a sequence feature: the layers of eq. 1-3 against a plain per-row computation over
the real tokens only (so padding is proven masked), padding and batch invariance, the causal
mask, the position buckets, several tasks, the pipeline's tracer."""

import dataclasses
import math

import pytest
import torch
from torch.nn import functional as F
from torchrec import JaggedTensor, KeyedJaggedTensor

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from recsys_dist.data.spec import FeatureSpec, make_sequence_tables, make_tables
from recsys_dist.models import hstu_attention, hstu_time
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


def config(**kw) -> HSTUConfig:
    """The tests' small HSTU (width E, HEADS heads of DQK / DV, no dropout), with ``kw`` on top."""
    return HSTUConfig(
        target_feature="movie",
        embedding_dim=E,
        deep_layer_sizes=[8],
        num_heads=HEADS,
        attention_dim=DQK,
        linear_dim=DV,
        layer_dropout=0.0,
        **kw,
    )


def build(tasks=("label",), **kw):
    cfg = config(**kw)
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
    # the rating actions ship (benchmarks/results/hstu_time_actions_cpu2core_20261205.md), the time bias not
    assert loaded.model.action_tokens and loaded.data.schema.history.action == "rating"
    assert loaded.model.time_buckets == 0 and not loaded.data.schema.history.times
    with pytest.raises(ConfigError, match=r"model\.transformer_dropout"):
        load_config(cfg, ["model.transformer_dropout=0.1"])
    with pytest.raises(ConfigError, match=r"model\.max_positions"):
        load_config(cfg, ["model.max_positions=1"])


# ---------------------------------------------------------------- time bias rab^t and action tokens

T_BUCKETS = 40


def spec_extras(tasks=("label",)):
    """The spec of a history with actions (``history_action``, 6 ratings) and times (``history_time``)."""
    return FeatureSpec(
        dense_names=["d"],
        sparse_names=["user", "movie"],
        tables=make_tables(["user", "movie"], [10, 20], E),
        embedding_device=torch.device("cpu"),
        sequence_names=["history", "history_action"],
        sequence_tables=make_sequence_tables(["history", "history_action"], [20, 6], E),
        tasks=list(tasks),
        value_names=["history_time"],
    )


# (user, movie, [(history id, action id, seconds before the row)]), oldest event first
XROWS = [
    (1, 9, [(3, 1, 10**8), (4, 5, 86400 * 30), (5, 2, 3600), (6, 4, 59)]),
    (2, 8, []),
    (3, 7, [(7, 3, 1)]),
    (4, 6, [(2, 2, 500), (2, 2, 500), (9, 1, 0)]),  # ties and an event 0 s (floored) before the row
]


def xkjt_of(rows):
    hist = [e for r in rows for e in r[2]]
    values = [r[0] for r in rows] + [r[1] for r in rows] + [e[0] for e in hist] + [e[1] for e in hist]
    values += [1 + e[2] for e in hist]  # raw values are stored as 1 + d
    lengths = [1] * (2 * len(rows)) + [len(r[2]) for r in rows] * 3
    return KeyedJaggedTensor(
        keys=["user", "movie", "history", "history_action", "history_time"],
        values=torch.tensor(values),
        lengths=torch.tensor(lengths),
    )


def build_extras(time_buckets=T_BUCKETS, action_tokens=True, num_layers=2, **kw):
    cfg = config(num_layers=num_layers, time_buckets=time_buckets, action_tokens=action_tokens, **kw)
    torch.manual_seed(0)
    s = spec_extras()
    if not action_tokens:
        s = dataclasses.replace(
            s, sequence_names=["history"], sequence_tables=make_sequence_tables(["history"], [20], E)
        )
    if not time_buckets:
        s = dataclasses.replace(s, value_names=[])
    model = get_model("hstu").build(s, cfg)
    with torch.no_grad():
        for p in [*model.sparse_arch.parameters(), *model.seq_arch.parameters()]:
            p.uniform_(-1, 1)
        for layer in model.stacks[0]:  # time weights far from 0, so a wrong bucket shows
            if time_buckets:
                layer.time_bias.uniform_(-2, 2)
    return model


def time_bucket_loop(dt: int, n: int) -> int:
    """The reference's bucket of a time difference, in plain Python."""
    return min(int(math.floor(math.log(max(abs(dt), 1)) / 0.301)), n - 1)


def layer_reference_t(layer, x, times, num_buckets):
    """``layer_reference`` plus ``rab^t``: ``times`` [n] the tokens' times (the target's last);
    query i reads key j with ``time_bias[bucket(times[i + 1] - times[j])]`` (the last token's next
    time is its own)."""
    n = len(x)
    norm = F.layer_norm(x, (E,), eps=1e-6)
    uvqk = F.silu(norm @ layer.f1.weight.T)
    u, v, q, k = uvqk.split([HEADS * DV, HEADS * DV, HEADS * DQK, HEADS * DQK], dim=1)
    out = torch.zeros(n, HEADS * DV)
    for h in range(HEADS):
        qh, kh, vh = q[:, h * DQK : (h + 1) * DQK], k[:, h * DQK : (h + 1) * DQK], v[:, h * DV : (h + 1) * DV]
        for i in range(n):
            nxt = times[min(i + 1, n - 1)]
            w = torch.zeros(i + 1)
            for j in range(i + 1):
                rab = layer.position_bias[position_bucket(torch.tensor(i - j), num_buckets)]
                if hasattr(layer, "time_bias"):
                    rab = rab + layer.time_bias[time_bucket_loop(nxt - times[j], len(layer.time_bias))]
                w[j] = F.silu(qh[i] @ kh[j] + rab) / (i + 1)
            out[i, h * DV : (h + 1) * DV] = w @ vh[: i + 1]
    return x + layer.f2(F.layer_norm(out, (HEADS * DV,), eps=1e-6) * u)


@pytest.mark.parametrize("time_buckets,action_tokens", [(T_BUCKETS, True), (T_BUCKETS, False), (0, True), (3, True)])
def test_time_bias_and_actions_match_a_plain_per_row_computation(time_buckets, action_tokens):
    model = build_extras(time_buckets, action_tokens).eval()
    rows = XROWS if action_tokens or time_buckets else ROWS
    kjt = xkjt_of(rows)
    if not action_tokens:  # the same rows without the action key
        kjt = KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in kjt.keys() if k != "history_action"})
    if not time_buckets:
        kjt = KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in kjt.keys() if k != "history_time"})
    dense = torch.randn(len(rows), 1)
    logits = model(dense, kjt)
    pooled = model.sparse_arch(kjt).to_dict()
    seq = model.seq_arch(kjt)
    feats = []
    for b, row in enumerate(rows):
        h = seq["history"].to_dense()[b]
        target = pooled["movie"][b : b + 1]
        if action_tokens:
            h = h + seq["history_action"].to_dense()[b]
            target = target + model.target_action[0]
        x = torch.cat([h, target])
        times = [-e[2] for e in row[2]] + [0]  # times relative to the row's: the target's is 0
        for layer in model.stacks[0]:
            x = layer_reference_t(layer, x, times, model.max_positions)
        feats.append(x[-1])
    x = torch.cat([dense, pooled["user"], pooled["movie"], torch.stack(feats)], dim=1)
    torch.testing.assert_close(logits, model.deep(x), rtol=0, atol=2e-6)


def test_time_bias_changes_the_logits_and_reads_the_times():
    model = build_extras().eval()
    dense = torch.zeros(4, 1)
    base = model(dense, xkjt_of(XROWS))
    moved = [XROWS[0][:2] + ([(3, 1, 10**8), (4, 5, 86400 * 30), (5, 2, 3600), (6, 4, 10**5)],), *XROWS[1:]]
    other = model(dense, xkjt_of(moved))
    assert not torch.allclose(base[0], other[0]) and torch.equal(base[1:], other[1:])


def test_with_extras_a_rows_logit_does_not_depend_on_padding_or_the_other_rows():
    model = build_extras().eval()
    dense = torch.randn(4, 1)
    base = model(dense, xkjt_of(XROWS))
    longer = [XROWS[0], (2, 8, [(i % 19 + 1, i % 5 + 1, 10**6 - i) for i in range(12)]), *XROWS[2:]]
    torch.testing.assert_close(model(dense, xkjt_of(longer))[[0, 2, 3]], base[[0, 2, 3]], rtol=0, atol=1e-6)
    order = [3, 0, 2, 1]
    torch.testing.assert_close(model(dense[order], xkjt_of([XROWS[i] for i in order])), base[order], rtol=0, atol=1e-6)
    for b in range(4):
        torch.testing.assert_close(model(dense[b : b + 1], xkjt_of([XROWS[b]])), base[b : b + 1], rtol=0, atol=1e-6)


def test_with_time_bias_later_events_never_change_earlier_outputs():
    """Output i reads events 1..i and the time of event i + 1 (the reference's next-token time):
    items, actions and times from event i + 2 on never change it."""
    model = build_extras(num_layers=3).eval()
    stack = model.stacks[0]
    torch.manual_seed(1)
    values, target, mask = torch.randn(1, 6, E), torch.randn(1, E), torch.ones(1, 6)
    deltas = torch.tensor([[10**7, 10**6, 10**5, 5000, 300, 20]])

    def outputs(values, deltas):
        weight, hb, tb = target_layout(mask, model.max_positions)
        buckets = hstu_time.time_buckets(deltas, T_BUCKETS)
        x = torch.cat([values, target.unsqueeze(1)], dim=1)
        for layer in stack:
            x = layer(x, weight, hb, tb, buckets)
        return x

    base = outputs(values, deltas)
    later, later_d = values.clone(), deltas.clone()
    later[0, 4:] = torch.randn(2, E)
    later_d[0, 5] = 7  # event 6's time moves: output 5 (which reads it as its next time) may move, 1-4 not
    got = outputs(later, later_d)
    torch.testing.assert_close(got[0, :4], base[0, :4], rtol=0, atol=0)
    assert not torch.allclose(got[0, 4:], base[0, 4:])


def test_time_buckets_follow_the_reference():
    dt = torch.tensor([0, 1, 2, 3, 59, 60, 3600, 86400, 10**9, -3600])
    assert hstu_time.time_bucket_of(dt, 1000).tolist() == [time_bucket_loop(int(d), 1000) for d in dt]
    assert hstu_time.time_bucket_of(dt, 1000).tolist() == [0, 0, 2, 3, 13, 13, 27, 37, 68, 27]
    assert hstu_time.time_bucket_of(dt, 30).tolist()[-2:] == [29, 27]  # the last bucket takes the rest
    # padding: row 0 has 2 of 3 events; its last event's next time is the target's (d = 0)
    b = hstu_time.time_buckets(torch.tensor([[100, 10, 0], [100, 10, 1]]), 1000)
    assert b.shape == (2, 4, 4)
    assert b[0, 1, :2].tolist() == [time_bucket_loop(100, 1000), time_bucket_loop(10, 1000)]
    assert b[1, 1, :3].tolist() == [time_bucket_loop(99, 1000), time_bucket_loop(9, 1000), 0]


def test_both_off_is_the_model_from_before_them():
    """No time bias, no actions: the same parameters and the logits the model gave before the
    options existed (commit f7709c9, this file's ``build`` and ``batch``), in eval and train."""
    model = build(num_layers=2).eval()
    assert not [n for n in model.state_dict() if "time_bias" in n or "target_action" in n]
    torch.manual_seed(5)
    got = model(torch.randn(3, 1), batch()).flatten().tolist()
    assert got == pytest.approx([-0.34474509954452515, -0.22093522548675537, -0.24953532218933105], abs=1e-7)
    model = build(tasks=("a", "b")).train()
    torch.manual_seed(6)
    got = model(torch.randn(3, 1), batch()).flatten().tolist()
    old = [-0.23400761187076569, 0.11134912073612213, -0.13479936122894287, 0.14933058619499207]
    assert got == pytest.approx(old + [-0.3434739112854004, 0.10046412795782089], abs=1e-7)


def test_unused_or_missing_actions_and_times_are_refused():
    with pytest.raises(ValueError, match=r"history_action.*model.action_tokens is false"):
        get_model("hstu").build(
            spec_extras(), HSTUConfig(target_feature="movie", embedding_dim=E, deep_layer_sizes=[8], time_buckets=4)
        )
    with pytest.raises(ValueError, match=r"history_time.*model.time_buckets is 0"):
        get_model("hstu").build(
            spec_extras(), HSTUConfig(target_feature="movie", embedding_dim=E, deep_layer_sizes=[8], action_tokens=True)
        )
    with pytest.raises(ValueError, match=r"model.time_buckets: 4 needs each sequence's event times"):
        get_model("hstu").build(
            spec(), HSTUConfig(target_feature="movie", embedding_dim=E, deep_layer_sizes=[8], time_buckets=4)
        )
    with pytest.raises(ValueError, match=r"model.action_tokens: true needs each sequence's actions"):
        get_model("hstu").build(
            spec(), HSTUConfig(target_feature="movie", embedding_dim=E, deep_layer_sizes=[8], action_tokens=True)
        )
    model = build_extras().eval()
    kjt = xkjt_of(XROWS)
    jts = {k: kjt[k] for k in kjt.keys()}
    jts["history_time"] = JaggedTensor(values=jts["history_time"].values()[:-1], lengths=torch.tensor([4, 0, 1, 2]))
    with pytest.raises(ValueError, match=r"history_time: rows' counts of times"):
        model(torch.zeros(4, 1), KeyedJaggedTensor.from_jt_dict(jts))


def test_hstu_with_extras_traces_with_torchrecs_pipeline_tracer():
    from torch.fx import GraphModule
    from torchrec.distributed.train_pipeline.tracing import Tracer

    model = build_extras().eval()
    traced = GraphModule(model, Tracer(leaf_modules=["sparse_arch", "seq_arch"]).trace(model))
    kjt = xkjt_of(XROWS)
    dense = torch.randn(4, 1)
    torch.testing.assert_close(traced(dense, kjt), model(dense, kjt), rtol=0, atol=0)


def test_din_bst_and_hstu_preflight_checks_name_the_history_options():
    from types import SimpleNamespace

    from recsys_dist.data.config import SchemaConfig
    from recsys_dist.models.checks import no_history_extras
    from recsys_dist.models.zoo.hstu import hstu_inputs

    hist = {"user": "u", "item": "i", "time": "t", "max_length": 4, "action": "r", "times": True}
    data = SimpleNamespace(schema=SchemaConfig(label="c", categorical=["i"], history=hist))
    for name in ("din", "bst", "hstu_retrieval"):
        (problem,) = no_history_extras(SimpleNamespace(data=data, model=SimpleNamespace(name=name)))
        assert f"model.name: {name} does not read data.schema.history.action / data.schema.history.times" in problem
    plain = SimpleNamespace(schema=SchemaConfig(label="c", categorical=["i"], history={**hist, "action": None}))
    plain.schema.history.times = False
    assert no_history_extras(SimpleNamespace(data=plain, model=SimpleNamespace(name="din"))) == []
    s = spec_extras()
    job = SimpleNamespace(features=s, model=SimpleNamespace(time_buckets=0, action_tokens=True))
    (problem,) = hstu_inputs(job)
    assert "model.time_buckets is 0" in problem
    job.model.time_buckets = 8
    assert hstu_inputs(job) == []


def test_actions_not_one_per_event_are_refused():
    """Actions that do not pair with the history's events (another count in a row) would be added
    to the wrong events (padding lines them up when the longest rows agree): an error."""
    model = build_extras(time_buckets=0).eval()
    kjt = xkjt_of(XROWS)
    jts = {k: kjt[k] for k in kjt.keys() if k != "history_time"}
    a = jts["history_action"]
    jts["history_action"] = JaggedTensor(values=a.values(), lengths=torch.tensor([4, 1, 0, 3]))  # rows 1, 2 swapped
    with pytest.raises(ValueError, match=r"history_action: rows' counts of actions"):
        model(torch.zeros(4, 1), KeyedJaggedTensor.from_jt_dict(jts))
