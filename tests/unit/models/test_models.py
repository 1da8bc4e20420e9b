"""Every model: output shape, gradient flow to every parameter, sharded == unsharded."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.data.formats.criteo import DENSE_NAMES, SPARSE_NAMES
from recsys_dist.data.loader import CTRBatch
from recsys_dist.models.build import build_model
from tests.conftest import QUICKSTART

MODELS = ["dlrm", "dlrm_dcnv2", "dcnv2", "deepfm", "wide_deep", "xdeepfm"]


def model_of(cfg, tables=torch.device("cpu")):
    """The config's model with its loss, dense parameters on cpu, tables on ``tables``."""
    job = resolve_job(cfg)
    return build_model(job.model, job.features.on(tables, torch.device("cpu")), job.train)


def batch(B=6):
    g = torch.Generator().manual_seed(0)
    kjt = KeyedJaggedTensor(
        keys=SPARSE_NAMES,
        values=torch.randint(0, 100, (26 * B,), generator=g),
        lengths=torch.ones(26 * B, dtype=torch.int32),
        stride=B,
    )
    return CTRBatch(
        dense_features=torch.rand(B, len(DENSE_NAMES), generator=g),
        sparse_features=kjt,
        labels=torch.randint(0, 2, (B,), generator=g).float(),
        weights=torch.ones(B),
    )


@pytest.mark.parametrize("name", MODELS)
def test_shapes_and_gradient_flow(name):
    extra = ["model.dcn_low_rank_dim=8"] if name == "dlrm_dcnv2" else []
    cfg = load_config(QUICKSTART, [f"model.name={name}", "data.num_embeddings=100", *extra])
    model = model_of(cfg)
    loss, (_, logits, labels, _) = model(batch())
    assert logits.shape == (6,) and labels.shape == (6,) and torch.isfinite(loss)
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, no_grad


@pytest.mark.parametrize("name", MODELS)
def test_bf16_mixed_runs_the_matmuls_in_bf16_and_keeps_float32_state(name):
    extra = ["model.dcn_low_rank_dim=8"] if name == "dlrm_dcnv2" else []
    models = {}
    for precision in ("fp32", "bf16-mixed"):
        cfg = load_config(
            QUICKSTART, [f"model.name={name}", "data.num_embeddings=100", f"train.precision={precision}", *extra]
        )
        torch.manual_seed(0)
        models[precision] = model_of(cfg)
    ref, mixed = models["fp32"], models["bf16-mixed"]
    mixed.load_state_dict(ref.state_dict())
    linear_out = []
    first = next(m for m in mixed.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda mod, args, out: linear_out.append(out.dtype))
    loss, (_, logits, _, _) = mixed(batch(64))
    want_loss, (_, want, _, _) = ref(batch(64))
    assert linear_out == [torch.bfloat16] and logits.dtype == loss.dtype == torch.float32
    # bfloat16 keeps 8 significant bits: logits agree to about 1% of their scale.
    assert (logits - want).abs().max() <= 0.02 * want.abs().max() + 1e-3
    assert loss.item() == pytest.approx(want_loss.item(), rel=0.01)
    loss.backward()
    for n, p in mixed.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, n
        assert p.grad.abs().sum() > 0, n


def test_first_order_tables_only_where_the_model_has_them():
    def names(m):
        return {t.name[:2] for t in resolve_job(load_config(QUICKSTART, [f"model.name={m}"])).features.planned_tables()}

    assert names("deepfm") == names("wide_deep") == names("xdeepfm") == {"t_", "w_"}
    assert names("dcnv2") == names("dlrm") == {"t_"}


def test_embeddings_and_first_order_are_read_by_key_in_any_column_layout():
    """A sharded EmbeddingBagCollection may return its tables' columns in another order (per
    rank): the split reads them by key, as a view when they are in order, else by gather."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    from recsys_dist.models.layers import pooled_and_first_order, pooled_embeddings

    B, E = 5, 8
    deep, first = [f"f{i}@t_f{i}" for i in range(3)], [f"f{i}@w_f{i}" for i in range(3)]
    cols = {k: torch.randn(B, E) for k in deep} | {k: torch.randn(B, 4) for k in first}
    want_v = torch.stack([cols[k] for k in deep], dim=1)
    want_first = sum(cols[k].mean(dim=1) for k in first)
    layouts = [deep + first, first[::-1] + deep, [deep[2], first[0], deep[0], first[2], deep[1], first[1]]]
    for keys in layouts:
        kt = KeyedTensor.from_tensor_list(keys, [cols[k] for k in keys])
        v, w = pooled_and_first_order(kt, deep, first)
        assert torch.equal(v, want_v) and torch.allclose(w, want_first), keys
        assert torch.equal(pooled_embeddings(kt, deep), want_v)
    in_order = KeyedTensor.from_tensor_list(deep + first, [cols[k] for k in deep + first])
    assert pooled_and_first_order(in_order, deep, first)[0]._base is in_order.values()  # a view, no copy


def test_deepfm_family_needs_a_first_order_table_per_feature():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recsys_dist.models.zoo.fm import DeepFM

    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=10, feature_names=[f]) for f in "ab"]
    tables.append(EmbeddingBagConfig(name="w_a", embedding_dim=4, num_embeddings=10, feature_names=["a"]))
    with pytest.raises(ValueError, match=r"features without both: \['b'\]"):
        DeepFM(EmbeddingBagCollection(tables=tables), 13, ["a", "b"], 8, [16])


@pytest.mark.parametrize("norm,activation,dropout", [("batch", "gelu", 0.2), ("layer", "silu", 0.0)])
def test_dense_tower_options(norm, activation, dropout):
    cfg = load_config(
        QUICKSTART,
        [
            "model.name=dcnv2",
            "data.num_embeddings=100",
            f"model.norm={norm}",
            f"model.activation={activation}",
            f"model.dropout={dropout}",
        ],
    )
    model = model_of(cfg)
    kinds = {type(m).__name__ for m in model.modules()}
    assert ("BatchNorm1d" if norm == "batch" else "LayerNorm") in kinds
    assert ("GELU" if activation == "gelu" else "SiLU") in kinds and ("Dropout" in kinds) == (dropout > 0)
    loss, _ = model(batch())
    loss.backward()


@pytest.mark.parametrize("name", ["deepfm", "wide_deep", "xdeepfm", "dcnv2"])
def test_mlp_init_std(name):
    cfg = load_config(QUICKSTART, [f"model.name={name}", "model.mlp_init_std=0.0001", "model.deep_layer_sizes=[512]"])
    task = model_of(cfg, tables=torch.device("meta"))
    first = next(m for n, m in task.named_modules() if isinstance(m, torch.nn.Linear) and m.out_features == 512)
    assert first.weight.std().item() == pytest.approx(1e-4, rel=0.05)
    default = model_of(
        load_config(QUICKSTART, [f"model.name={name}", "model.deep_layer_sizes=[512]"]), tables=torch.device("meta")
    )
    assert (
        next(m for m in default.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 512)
        .weight.std()
        .item()
        > 1e-2
    )
