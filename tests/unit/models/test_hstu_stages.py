"""Issue 38 item 6 (in process): HSTU cut into pipeline stages (``recsys_dist.models.zoo.hstu_stages``).
Composed, the tower over ``pipeline_input``'s one row per example is ``HSTU.forward`` (every
attention kernel, the time bias and the action tokens on and off, the history's max length the
batch's longest or longer), the row packs the times exactly, what cannot be packed is refused
naming the feature, and ``recsys-dist plan``'s layout shows HSTU's stages."""

import dataclasses

import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.data.spec import FeatureSpec, make_sequence_tables, make_tables
from recsys_dist.distributed.pipeline_traffic import pipeline_layout
from recsys_dist.distributed.stages import cut_model
from recsys_dist.models import hstu_attention
from recsys_dist.models.build import build_model
from recsys_dist.models.registry import get_model
from recsys_dist.models.zoo import hstu_stages
from recsys_dist.train.preflight import section_problems
from tests.conftest import ROOT
from tests.unit.models.test_hstu import T_BUCKETS, XROWS, E, build_extras, config, xkjt_of

HSTU = ROOT / "configs" / "movielens_hstu.yaml"
LONGEST = max(len(r[2]) for r in XROWS)  # 4 events


def with_lengths(model, length: int):
    """``model`` with every history of max length ``length`` (as ``FeatureSpec.sequence_lengths`` gives)."""
    model.sequence_lengths = {h: length for h in model.histories}
    return model


def inputs(time_buckets: int, action_tokens: bool, rows=XROWS):
    kjt = xkjt_of(rows)
    drop = {k for k, on in (("history_action", action_tokens), ("history_time", time_buckets)) if not on}
    return torch.randn(len(rows), 1), KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in kjt.keys() if k not in drop})


def run_tower(model, dense, kjt):
    tower, why = cut_model(model)
    assert tower is not None, why
    x = model.pipeline_input(dense, kjt)
    for module in tower:
        x = module(x)
    return x, tower


@pytest.mark.parametrize("kernel", ["dense", "chunked", "auto"])
@pytest.mark.parametrize("time_buckets,action_tokens", [(T_BUCKETS, True), (0, False), (T_BUCKETS, False)])
@pytest.mark.parametrize("length", [LONGEST, LONGEST + 3])
def test_the_composed_tower_is_the_models_forward(kernel, time_buckets, action_tokens, length, monkeypatch):
    """Logits to the bit, also when the stages pad further than the batch's longest (each layer
    runs on the real tokens, packed, as forward does); the gradients of every dense parameter
    alike (train mode)."""
    monkeypatch.setattr(hstu_attention, "CHUNK_QUERIES", 2)  # the chunked kernel in several chunks
    model = with_lengths(build_extras(time_buckets, action_tokens, attention=kernel), length)
    dense, kjt = inputs(time_buckets, action_tokens)
    want = model(dense, kjt)
    grads_want = torch.autograd.grad(want.sum(), list(model.parameters()), allow_unused=True)
    got, tower = run_tower(model, dense, kjt)
    grads_got = torch.autograd.grad(got.sum(), list(model.parameters()), allow_unused=True)
    assert torch.equal(got, want)
    for a, b in zip(grads_got, grads_want, strict=True):  # the tables' too, through pipeline_input
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    names = [type(m).__name__ for m in tower]
    # the head's hidden layer (one: deep_layer_sizes [8]) and its output layer after Head
    assert names == ["TargetAction"] * action_tokens + ["LayerStage", "LayerStage", "Head", "Linear"]
    # every dense parameter in exactly one module (the model's own), none in pipeline_input
    tables = {id(p) for p in [*model.sparse_arch.parameters(), *model.seq_arch.parameters()]}
    in_tower = [p for m in tower for p in m.parameters()]
    assert len(in_tower) == len({id(p) for p in in_tower})
    assert {id(p) for p in in_tower} == {id(p) for p in model.parameters() if id(p) not in tables}


def test_the_row_layout_and_the_times_packing_are_exact():
    model = with_lengths(build_extras(T_BUCKETS, True), 6)
    dense, kjt = inputs(T_BUCKETS, True)
    x = model.pipeline_input(dense, kjt)
    (s,) = model.pipeline_slots()
    head = 1 + 2 * E  # dense, user, movie
    assert (s.start, s.count, s.end) == (head, head + 7 * E, head + 7 * E + 1 + 12) and x.shape == (4, s.end)
    assert x[:, s.count].tolist() == [4, 0, 1, 3]  # the events per row
    times = hstu_stages.join_deltas(x, s)
    assert times[0].tolist() == [10**8, 86400 * 30, 3600, 59, 0, 0] and times[1].tolist() == [0] * 6
    # up to 2^48 - 1 units exactly (hi and lo both below 2^24), beyond refused naming the feature
    d = torch.tensor([[2**48 - 1, 2**24, 2**24 - 1, 0, 1, 12345678901234]])
    row = torch.cat([torch.zeros(1, s.count + 1), *hstu_stages.split_deltas(d, "history_time")], dim=1)
    assert torch.equal(hstu_stages.join_deltas(row, dataclasses.replace(s, length=6)), d)
    with pytest.raises(ValueError, match=r"history_time: .* 2\^48 or more units .* use a coarser time unit"):
        hstu_stages.split_deltas(torch.tensor([[2**48]]), "history_time")


def test_a_history_longer_than_its_max_length_is_refused_not_cut():
    model = with_lengths(build_extras(0, False), LONGEST - 1)
    with pytest.raises(ValueError, match=r"history: a row holds 4 events, more than its max_length 3"):
        model.pipeline_input(*inputs(0, False))


def test_a_history_of_unknown_length_cannot_be_cut_and_says_why():
    tower, why = cut_model(build_extras(0, False))  # a hand-made FeatureSpec: no sequence_lengths
    assert tower is None and "pad each history to its max length, unknown for ['history']" in why


def test_an_all_empty_batch_packs_and_runs():
    """A rank's padding batch: every history empty (its tokens are zeros but the target)."""
    model = with_lengths(build_extras(T_BUCKETS, True), LONGEST)
    rows = [(1, 2, []), (3, 4, [])]
    dense, kjt = inputs(T_BUCKETS, True, rows)
    got, _ = run_tower(model, dense, kjt)
    assert torch.equal(got, model(dense, kjt))


def test_the_shipped_config_has_its_lengths_and_the_plan_shows_hstus_stages():
    job = resolve_job(load_config(str(HSTU), ["distributed.dense.strategy=pipeline", "distributed.dense.stages=2"]))
    assert job.features.sequence_lengths == {"history": 50, "history_action": 50}
    assert section_problems(job) == []
    model = build_model(job.model, job.features.on(torch.device("meta")), job.train)
    layout, why = pipeline_layout(model, job.distributed.dense, 2, job.features.num_dense, list(job.features.keys))
    assert layout is not None, why
    width = 3 * 16 + 51 * 16 + 1  # userId, movieId, genres; 50 events and the target; the count
    # the target action, 2 layers, the head's 2 hidden layers and its output layer
    assert layout.input_width == width and layout.modules == 6
    # split auto: stage 0 the layers and the head's first layer (its 128 outputs go to stage 1)
    assert layout.widths == [128, 1] and layout.starts == [0, 4]
    # with the time bias: 50 events' times in two columns each
    times = ["data.schema.history.times=true", "model.time_buckets=128"]
    job = resolve_job(
        load_config(str(HSTU), ["distributed.dense.strategy=pipeline", "distributed.dense.stages=2", *times])
    )
    assert job.features.sequence_lengths == {"history": 50, "history_action": 50, "history_time": 50}
    model = build_model(job.model, job.features.on(torch.device("meta")), job.train)
    layout, why = pipeline_layout(model, job.distributed.dense, 2, job.features.num_dense, list(job.features.keys))
    assert layout is not None and layout.input_width == width + 100, why


def test_hstu_retrieval_stays_refused_and_says_why():
    job = resolve_job(
        load_config(
            str(ROOT / "configs" / "movielens_hstu_retrieval.yaml"),
            ["distributed.dense.strategy=pipeline", "distributed.dense.stages=2"],
        )
    )
    problems = section_problems(job)
    assert any("not hstu_retrieval or sasrec_retrieval: their in-batch sampled softmax" in p for p in problems), (
        problems
    )


def test_a_spec_without_lengths_builds_and_runs_as_before():
    """sequence_lengths only matters to the stages: the model's forward needs none."""
    model = build_extras(0, False)
    assert model.sequence_lengths == {}
    dense, kjt = inputs(0, False)
    assert model(dense, kjt).shape == (4, 1)


def test_two_histories_each_with_its_own_length_and_stack():
    """Two sequence features (data.schema.sequence: each its own max_length): their slots follow
    each other in the row, each layer's module reads its own."""
    spec = FeatureSpec(
        dense_names=["d"],
        sparse_names=["user", "movie"],
        tables=make_tables(["user", "movie"], [10, 20], E),
        embedding_device=torch.device("cpu"),
        sequence_names=["history", "tags"],
        sequence_tables=make_sequence_tables(["history", "tags"], [20, 20], E),
        sequence_lengths={"history": 5, "tags": 3},
    )
    torch.manual_seed(0)
    model = get_model("hstu").build(spec, config(num_layers=1))
    with torch.no_grad():
        for p in [*model.sparse_arch.parameters(), *model.seq_arch.parameters()]:
            p.uniform_(-1, 1)
    rows = [(1, 9, [3, 4, 5, 6], [1, 2]), (2, 8, [], [7, 7, 7]), (3, 7, [7], [])]
    values = [r[0] for r in rows] + [r[1] for r in rows] + [h for r in rows for h in r[2]]
    values += [t for r in rows for t in r[3]]
    lengths = [1] * 6 + [len(r[2]) for r in rows] + [len(r[3]) for r in rows]
    kjt = KeyedJaggedTensor(
        keys=["user", "movie", "history", "tags"], values=torch.tensor(values), lengths=torch.tensor(lengths)
    )
    dense = torch.randn(3, 1)
    got, tower = run_tower(model, dense, kjt)
    assert torch.equal(got, model(dense, kjt))
    a, b = model.pipeline_slots()
    assert (a.start, b.start, b.end) == (1 + 2 * E, a.end, a.end + 4 * E + 1)
    assert [m.slots.name for m in tower if isinstance(m, hstu_stages.LayerStage)] == ["history", "tags"]
