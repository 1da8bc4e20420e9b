"""HSTU's layers over packed tokens (recsys_dist.models.hstu_jagged) against the padded computation
they replace (``HSTULayer.forward`` over ``target_layout`` / the plain causal layout, kept as the
reference): outputs at every real token and every gradient, float64, each kernel, with the time
bias and action tokens, rows of length 0, 1 and the longest, and all rows full."""

import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingCollection

from recsys_dist.models import hstu_attention, hstu_jagged, hstu_time
from recsys_dist.models.hstu_jagged import position_bucket
from recsys_dist.models.hstu_retrieval import HSTURetrieval, item_table
from recsys_dist.models.zoo.hstu import HSTULayer, target_layout

E, HEADS, DQK, DV, BUCKETS, T_BUCKETS = 8, 2, 4, 3, 8, 16


def causal_layout(mask: torch.Tensor, num_buckets: int):
    """The padded arguments of ``HSTULayer.forward`` for a plain causal sequence (no target token),
    as ``HSTURetrieval.encode`` built them before the jagged layers."""
    batch, n = mask.shape
    idx = torch.arange(n)
    allowed = (idx[:, None] >= idx[None, :]).to(mask.dtype)[None] * mask[:, None, :]
    weight = allowed / allowed.sum(dim=2, keepdim=True).clamp(min=1)
    bucket = position_bucket((idx[:, None] - idx[None, :]).clamp(min=0), num_buckets)
    return weight, bucket, bucket[-1].expand(batch, n)


def stack(kernel: str, time_buckets: int = T_BUCKETS, layers: int = 2) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    mods = torch.nn.ModuleList(
        HSTULayer(E, HEADS, DQK, DV, BUCKETS, 0.0, attention=kernel, time_buckets=time_buckets) for _ in range(layers)
    ).double()
    with torch.no_grad():  # biases away from 0 so a wrong bucket or key moves the outputs
        for layer in mods:
            layer.position_bias.uniform_(-1, 1)
            if time_buckets:
                layer.time_bias.uniform_(-1, 1)
    return mods


def history(lengths: list[int], seed: int = 1):
    """values [B, L, E] float64 (0 on padding), mask [B, L], target [B, E], deltas int64 [B, L]."""
    g = torch.Generator().manual_seed(seed)
    longest = max(max(lengths), 1)
    mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).double()
    values = torch.randn(len(lengths), longest, E, generator=g, dtype=torch.float64) * mask[..., None]
    target = torch.randn(len(lengths), E, generator=g, dtype=torch.float64)
    deltas = torch.randint(0, 10**6, (len(lengths), longest), generator=g) * mask.long()
    return values.requires_grad_(), mask, target.requires_grad_(), deltas


def ranking_padded(layers, values, mask, target, deltas):
    """[B, L + 1, E]: the padded layers (the code path before the jagged one), target at index L."""
    weight, hb, tb = target_layout(mask, BUCKETS)
    buckets = hstu_time.time_buckets(deltas, T_BUCKETS) if deltas is not None else None
    x = torch.cat([values, target.unsqueeze(1)], dim=1)
    for layer in layers:
        x = layer(x, weight, hb, tb, buckets)
    return x


def ranking_jagged(layers, values, mask, target, deltas):
    """[B, L + 1, E]: the jagged layers' outputs unpacked (0 on padding)."""
    real = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1) > 0
    lay = hstu_jagged.layout(real.sum(dim=1))
    x = hstu_jagged.pack(torch.cat([values, target.unsqueeze(1)], dim=1), real)
    for layer in layers:
        x = layer(x, layout=lay, deltas=deltas)
    return hstu_jagged.unpack(x, real)


def assert_same_at(real, got, want, inputs):
    """Outputs at the real tokens, and the gradients of a probe of them w.r.t. ``inputs``."""
    real = real[..., None].to(got.dtype)
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=1e-12)
    probe = torch.randn(got.shape, generator=torch.Generator().manual_seed(7), dtype=got.dtype) * real
    g_got = torch.autograd.grad((got * probe).sum(), inputs, retain_graph=True, allow_unused=True)
    g_want = torch.autograd.grad((want * probe).sum(), inputs, retain_graph=True, allow_unused=True)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel", ["dense", "chunked", "auto"])
@pytest.mark.parametrize("lengths", [[0, 1, 9, 3, 9, 5, 2], [9, 9, 9]], ids=["ragged", "full"])
@pytest.mark.parametrize("time", [True, False], ids=["time_bias", "position_only"])
def test_ranking_layers_equal_the_padded_ones(kernel, lengths, time, monkeypatch):
    """Blocks of 4 query positions (10 tokens: 3 blocks, the last short); ``auto`` recomputes from
    100 scores, so it takes the chunked path here."""
    monkeypatch.setattr(hstu_jagged, "BLOCK", 4)
    monkeypatch.setattr(hstu_jagged, "AUTO_RECOMPUTE_SCORES", 100)
    monkeypatch.setattr(hstu_attention, "CHUNK_QUERIES", 3)
    layers = stack(kernel, T_BUCKETS if time else 0)
    values, mask, target, deltas = history(lengths)
    deltas = deltas if time else None
    want = ranking_padded(layers, values, mask, target, deltas)
    got = ranking_jagged(layers, values, mask, target, deltas)
    real = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype)], dim=1) > 0
    assert_same_at(real, got, want, [values, target, *layers.parameters()])


def test_a_batch_of_empty_histories_reads_the_target_alone():
    layers = stack("auto")
    values, mask, target, deltas = history([0, 0])
    want, got = (
        ranking_padded(layers, values, mask, target, deltas),
        ranking_jagged(layers, values, mask, target, deltas),
    )
    torch.testing.assert_close(got[:, -1], want[:, -1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel", ["dense", "chunked"])
def test_retrieval_encode_equals_the_padded_layers_also_for_an_empty_row(kernel, monkeypatch):
    """HSTURetrieval's positions, and an empty row's one token (the "empty history" vector: its
    position 0 reads nothing), equal the padded layers under the plain causal layout."""
    monkeypatch.setattr(hstu_jagged, "BLOCK", 2)
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=[item_table(20, E)])
    model = HSTURetrieval(ec, E, num_heads=HEADS, attention_dim=DQK, linear_dim=DV, dropout=0.0, max_positions=BUCKETS)
    model = model.double().eval()
    for layer in model.layers:
        layer.attention = kernel
    values, mask, _, _ = history([3, 0, 5, 1])
    weight, hb, tb = causal_layout(mask, BUCKETS)
    x = values * E**0.5 * mask[..., None]  # as HSTURetrieval.encode before the jagged layers
    for layer in model.layers:
        x = layer(x, weight, hb, tb)
    want = torch.nn.functional.normalize(x, dim=-1)
    got = model.encode(values, mask)
    real = mask > 0
    real[:, 0] = True  # an empty row's position 0: the user vector of an empty history
    assert_same_at(real, got, want, [values, *model.layers.parameters()])


def test_layout_packs_rows_longest_first_and_counts_each_blocks_rows():
    lay = hstu_jagged.layout(torch.tensor([2, 0, 5, 3]), block=2)
    assert lay.order.tolist() == [2, 3, 0, 1] and lay.width == 5
    assert lay.rows == (3, 2, 1)  # rows with more than 0, 2, 4 tokens
    # packed: row 0 -> 0, 1; row 2 -> 2..6; row 3 -> 7..9; 10 = past a row's end
    assert lay.to_padded.tolist() == [[2, 3, 4, 5, 6], [7, 8, 9, 10, 10], [0, 1, 10, 10, 10], [10] * 5]
    flat = torch.arange(10).view(-1, 1).double()
    padded = torch.nn.functional.pad(flat, (0, 0, 0, 1))[lay.to_padded].flatten()
    assert padded[lay.to_packed].flatten().tolist() == list(range(10))
    real = torch.tensor([[True, False], [True, True]])
    x = torch.arange(4.0).view(2, 2, 1)
    assert hstu_jagged.unpack(hstu_jagged.pack(x, real), real).flatten().tolist() == [0, 0, 2, 3]


def test_attention_skips_the_padding_rows_and_keys(monkeypatch):
    """The blocks' score matrices: one row of 40 tokens and 15 rows of 2 take 2 x 32 x 32 + 1 x 8 x 40
    query-key pairs a head at block 32 (plus the short rows' first block), not 16 x 40 x 40."""
    seen = []
    real_block = hstu_jagged._block

    def spy(q, k, *args):
        seen.append(q.shape[0] * q.shape[1] * k.shape[1])
        return real_block(q, k, *args)

    monkeypatch.setattr(hstu_jagged, "_block", spy)
    lay = hstu_jagged.layout(torch.tensor([40] + [2] * 15))
    q = torch.randn(70, HEADS, DQK)
    hstu_jagged.jagged_attention(q, q, torch.randn(70, HEADS, DV), lay, torch.zeros(BUCKETS), kernel="dense")
    assert seen == [16 * 32 * 32, 1 * 8 * 40]


def test_auto_recomputes_the_blocks_from_a_count_of_scores(monkeypatch):
    """``lay.pairs`` counts the blocks' (query, key) pairs; ``auto`` recomputes (checkpoint) from
    ``AUTO_RECOMPUTE_SCORES`` of them times the heads, ``chunked`` always, ``dense`` never."""
    calls = []
    monkeypatch.setattr(hstu_jagged, "checkpoint", lambda fn, *a, **k: calls.append(1) or fn(*a))
    lay = hstu_jagged.layout(torch.tensor([40] + [2] * 15))
    assert lay.pairs == 16 * 32 * 32 + 1 * 8 * 40
    q = torch.randn(70, HEADS, DQK, requires_grad=True)
    scores = lay.pairs * HEADS
    for kernel, threshold, want in [
        ("auto", scores, 2),
        ("auto", scores + 1, 0),
        ("chunked", 10**9, 2),
        ("dense", 1, 0),
    ]:
        calls.clear()
        monkeypatch.setattr(hstu_jagged, "AUTO_RECOMPUTE_SCORES", threshold)
        hstu_jagged.jagged_attention(q, q, torch.randn(70, HEADS, DV), lay, torch.zeros(BUCKETS), kernel=kernel)
        assert len(calls) == want, kernel


@pytest.mark.parametrize("kernel", ["dense", "chunked"])
def test_the_model_with_time_bias_and_actions_equals_its_padded_layers(kernel, monkeypatch):
    """The whole HSTU (action tokens and time bias on, rows of 4, 0, 1 and 3 events, blocks of 2):
    logits and every parameter's gradient equal the model whose ``encode`` runs the padded layers."""
    from tests.unit.models import test_hstu

    monkeypatch.setattr(hstu_jagged, "BLOCK", 2)
    model = test_hstu.build_extras(attention=kernel)
    kjt, dense = test_hstu.xkjt_of(test_hstu.XROWS), torch.randn(4, 1)

    calls = []

    def padded_encode(stack, values, mask, target, deltas=None):
        calls.append(deltas is not None)
        weight, hb, tb = target_layout(mask, model.max_positions)
        buckets = hstu_time.time_buckets(deltas, model.time_buckets)
        x = torch.cat([values, target.unsqueeze(1)], dim=1)
        for layer in stack:
            x = layer(x, weight, hb, tb, buckets)
        return x[:, -1, :]

    got = model(dense, kjt)
    g_got = torch.autograd.grad(got.sum(), list(model.parameters()), allow_unused=True)
    monkeypatch.setattr(model, "encode", padded_encode)
    want = model(dense, kjt)
    g_want = torch.autograd.grad(want.sum(), list(model.parameters()), allow_unused=True)
    assert calls == [True]  # the reference ran, with the times
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), g_got, g_want):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_the_models_call_their_layers_through_the_module_hooks():
    """FSDP unshards a layer's parameters in its forward pre-hook: HSTU and HSTURetrieval call the
    jagged layers through ``layer(...)``, so the hooks run (a direct ``forward_jagged`` call met
    FSDP's DTensor parameters: "got mixed torch.Tensor and DTensor"). One layout or the other."""
    from tests.unit.models import test_hstu

    model, calls = test_hstu.build(num_layers=2), []
    for layer in model.stacks[0]:
        layer.register_forward_pre_hook(lambda module, args: calls.append(module))
    model(torch.randn(3, 1), test_hstu.batch())
    assert calls == list(model.stacks[0])
    retrieval = HSTURetrieval(EmbeddingCollection(tables=[item_table(20, E)]), E, num_layers=2)
    for layer in retrieval.layers:
        layer.register_forward_pre_hook(lambda module, args: calls.append(module))
    calls.clear()
    values, mask, _, _ = history([2, 0])
    retrieval.encode(values.float(), mask.float())
    assert calls == list(retrieval.layers)
    layer, lay = model.stacks[0][0], hstu_jagged.layout(torch.tensor([1]))
    with pytest.raises(ValueError, match="either the padded layout"):
        layer(torch.zeros(1, E))
    with pytest.raises(ValueError, match="either the padded layout"):
        layer(torch.zeros(1, 1, E), torch.ones(1, 1, 1), layout=lay)
