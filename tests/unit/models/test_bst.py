"""BST over a sequence feature: the transformer of eq. 1-5 against a plain per-row computation
over the real positions only (so padding is proven masked), empty histories, positions."""

import math

import pytest
import torch
from torch.nn import functional as F
from torchrec import KeyedJaggedTensor

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from recsys_dist.data.spec import FeatureSpec, make_sequence_tables, make_tables
from recsys_dist.distributed.dense import dense_blocks
from recsys_dist.models.registry import get_model
from recsys_dist.models.zoo.bst import BSTConfig
from tests.conftest import ROOT

E, HEADS = 8, 2


def spec():
    return FeatureSpec(
        dense_names=["d"],
        sparse_names=["user", "movie"],
        tables=make_tables(["user", "movie"], [10, 20], E),
        embedding_device=torch.device("cpu"),
        sequence_names=["history"],
        sequence_tables=make_sequence_tables(["history"], [20], E),
    )


def batch():
    # rows: history [3, 4, 5, 6], [] (empty), [7]
    return KeyedJaggedTensor(
        keys=["user", "movie", "history"],
        values=torch.tensor([1, 2, 3, 9, 8, 7, 3, 4, 5, 6, 7]),
        lengths=torch.tensor([1, 1, 1, 1, 1, 1, 4, 0, 1]),
    )


def build(**kw):
    cfg = BSTConfig(target_feature="movie", embedding_dim=E, deep_layer_sizes=[8], num_heads=HEADS, ffn_size=12, **kw)
    torch.manual_seed(0)
    return get_model("bst").build(spec(), cfg)


def layer_reference(layer, x):
    """One post-norm encoder layer (eq. 1-5) over x [n, E], every position real."""
    wq, wk, wv = layer.self_attn.in_proj_weight.chunk(3)
    bq, bk, bv = layer.self_attn.in_proj_bias.chunk(3)
    d = E // HEADS
    heads = []
    for h in range(HEADS):
        cols = slice(h * d, (h + 1) * d)
        q, k, v = (x @ w[cols].T + b[cols] for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        heads.append(torch.softmax(q @ k.T / math.sqrt(d), dim=-1) @ v)
    s = layer.self_attn.out_proj(torch.cat(heads, dim=1))
    s1 = layer.norm1(x + s)
    return layer.norm2(s1 + layer.linear2(F.leaky_relu(layer.linear1(s1))))


@pytest.mark.parametrize("max_positions", [64, 3])
def test_bst_matches_a_plain_per_row_transformer(max_positions):
    model = build(max_positions=max_positions).eval()
    kjt, dense = batch(), torch.randn(3, 1)
    logits = model(dense, kjt)
    assert logits.shape == (3, 1)
    pooled = model.sparse_arch(kjt).to_dict()
    seq = model.seq_arch(kjt)["history"]
    p = model.positions[0]
    (layer,) = model.transformers[0]
    feats = []
    for b, h in enumerate(seq.to_dense()):
        n = len(h)
        # the target at position 0, then h_1..h_n (oldest first) at recency n..1, capped
        pos = [0] + [min(n - j, max_positions - 1) for j in range(n)]
        x = torch.cat([pooled["movie"][b : b + 1], h]) + p[pos]
        out = layer_reference(layer, x)
        hist = out[1:].mean(dim=0) if n else torch.zeros(E)
        feats.append(torch.cat([out[0], hist]))
    x = torch.cat([dense, pooled["user"], pooled["movie"], torch.stack(feats)], dim=1)
    torch.testing.assert_close(logits, model.deep(x), rtol=0, atol=1e-5)


def test_bst_reads_the_history_order_and_content():
    model = build().eval()
    kjt, dense = batch(), torch.zeros(3, 1)
    base = model(dense, kjt)
    for i, new in ((6, 11), (7, 3)):  # another movie in row 0's history; the order swapped
        v = kjt.values().clone()
        v[i] = new
        other = model(dense, KeyedJaggedTensor(keys=kjt.keys(), values=v, lengths=kjt.lengths()))
        assert not torch.allclose(base[0], other[0]) and torch.equal(base[1:], other[1:])


def test_bst_config_refuses_what_it_does_not_take():
    cfg = ROOT / "configs" / "movielens_bst.yaml"
    assert load_config(cfg).model.name == "bst"
    with pytest.raises(ConfigError, match=r"model\.attention_sizes"):
        load_config(cfg, ["model.attention_sizes=[8]"])
    with pytest.raises(ConfigError, match=r"model\.num_heads: 3 does not divide model\.embedding_dim 16"):
        load_config(cfg, ["model.num_heads=3"])


def test_bst_traces_with_torchrecs_pipeline_tracer():
    """TrainPipelineSparseDist traces the model with this tracer (the sharded collections are its
    leaves): the traced graph gives the model's logits."""
    from torch.fx import GraphModule
    from torchrec.distributed.train_pipeline.tracing import Tracer

    model = build().eval()
    graph = Tracer(leaf_modules=["sparse_arch", "seq_arch"]).trace(model)
    traced = GraphModule(model, graph)
    kjt, dense = batch(), torch.randn(3, 1)
    torch.testing.assert_close(traced(dense, kjt), model(dense, kjt), rtol=0, atol=0)


def test_bst_batch_whose_histories_are_all_empty_reads_the_target_alone():
    model = build().eval()
    kjt = KeyedJaggedTensor(
        keys=["user", "movie", "history"], values=torch.tensor([1, 2, 9, 8]), lengths=torch.tensor([1, 1, 1, 1, 0, 0])
    )
    dense = torch.zeros(2, 1)
    pooled = model.sparse_arch(kjt).to_dict()
    (layer,) = model.transformers[0]
    feats = [
        torch.cat([layer_reference(layer, pooled["movie"][b : b + 1] + model.positions[0][:1])[0], torch.zeros(E)])
        for b in range(2)
    ]
    x = torch.cat([dense, pooled["user"], pooled["movie"], torch.stack(feats)], dim=1)
    torch.testing.assert_close(model(dense, kjt), model.deep(x), rtol=0, atol=1e-5)


def test_every_block_fsdp_shards_is_called_through_its_own_forward():
    """distributed.dense.strategy: fsdp gathers a block's weights in the block's forward hooks
    (``dense.dense_blocks``): every block must be called, not iterated. Before, each history's
    transformer stack was an ``nn.Sequential`` (one block) whose layers BST called one by one:
    under fsdp every rank failed at its first step ("aten.mm.default got mixed torch.Tensor and
    DTensor"), at any world size, with or without replica groups."""
    model = build(num_blocks=2)
    blocks, _ = dense_blocks(model)
    called = set()
    for name in blocks:
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, kwargs, name=name: called.add(name), with_kwargs=True
        )
    model(torch.randn(3, 1), batch())
    assert called == set(blocks) and any(b.startswith("transformers.") for b in blocks), (blocks, called)
