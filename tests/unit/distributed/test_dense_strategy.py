"""``distributed.dense.strategy``: the config key, the registry of strategies, the blocks FSDP
shards, the per-rank dense bytes ``recsys-dist plan`` shows, and the clipping of sharded
gradients (in one process; the multi-rank checks are tests/ranks/distributed/test_dense_fsdp.py)."""

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim.keyed import KeyedOptimizerWrapper

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.distributed import dense
from recsys_dist.distributed.config import DENSE_STRATEGIES, DenseConfig
from recsys_dist.distributed.optim import GlobalNormClipping
from recsys_dist.distributed.sharders import OneRankDense
from recsys_dist.distributed.stages import PipelineDense
from recsys_dist.models.build import build_model
from recsys_dist.train.dry_run import dry_run
from tests.conftest import QUICKSTART


def test_default_is_ddp_and_fsdp_is_accepted():
    assert load_config(QUICKSTART).distributed.dense.strategy == "ddp"
    assert load_config(QUICKSTART, ["distributed.dense.strategy=fsdp"]).distributed.dense.strategy == "fsdp"


@pytest.mark.parametrize("bad", ["tensor", "zero3", "FSDP"])
def test_an_unknown_strategy_is_an_error_naming_the_key(bad):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [f"distributed.dense.strategy={bad}"])
    assert "distributed.dense.strategy" in str(e.value) and "'ddp', 'fsdp' or 'pipeline'" in str(e.value)


def test_a_pipeline_key_under_another_strategy_is_an_error():
    with pytest.raises(ConfigError, match="distributed.dense: stages: only strategy: pipeline reads it"):
        load_config(QUICKSTART, ["distributed.dense.stages=2"])


def test_one_wrapper_per_strategy_name():
    assert set(dense.WRAPPERS) == set(DENSE_STRATEGIES) == {"ddp", "fsdp", "pipeline"}
    assert isinstance(dense.dense_wrapper("ddp", 1), OneRankDense)
    assert dense.dense_wrapper("ddp", 2) is None  # TorchRec's DDP wrapper
    assert isinstance(dense.dense_wrapper("fsdp", 1), dense.FSDPDense)
    cfg = DenseConfig(strategy="pipeline", stages=2)
    assert isinstance(dense.dense_wrapper("pipeline", 2, cfg), PipelineDense)
    with pytest.raises(ValueError, match="distributed.dense.strategy"):
        dense.dense_wrapper("tensor", 2)


class Mixed(nn.Module):
    """Tables, two dense blocks, and a parameter set directly beside the tables."""

    def __init__(self):
        super().__init__()
        tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
        self.sparse = nn.ModuleDict({"ebc": EmbeddingBagCollection(tables=tables, device=torch.device("meta"))})
        self.sparse.scale = nn.Parameter(torch.ones(4))
        self.bottom = nn.Sequential(nn.Linear(3, 7), nn.ReLU(), nn.Linear(7, 4))
        self.over = nn.Linear(8, 1)
        self.act = nn.ReLU()  # no parameters: not a block


def test_blocks_are_the_largest_table_free_modules():
    blocks, rest = dense.dense_blocks(Mixed())
    assert blocks == ["bottom", "over"]
    assert rest == ["sparse.scale"]  # replicated (DDP) under fsdp


def test_planned_bytes_cut_dim_0_as_fsdp2_does():
    per_rank = dense.planned_dense_bytes(Mixed(), "fsdp", 3, "adam")
    # bottom.0: [7, 3] + [7] -> rows 3, 3, 1; bottom.2: [4, 7] + [4] -> 2, 2, 0; over: [1, 8] + [1] -> 1, 0, 0
    rows = [(3, 3, 2, 2, 1, 1), (3, 3, 2, 2, 0, 0), (1, 1, 0, 0, 0, 0)]
    widths = (3, 1, 7, 1, 8, 1)
    for got, r in zip(per_rank, rows, strict=True):
        params = 4 * (sum(a * w for a, w in zip(r, widths)) + 4)  # + sparse.scale, whole on every rank
        assert got == {"parameters": params, "gradients": params, "optimizer": 2 * params}
    ddp = dense.planned_dense_bytes(Mixed(), "ddp", 3, "sgd")
    assert ddp == [{"parameters": 4 * 73, "gradients": 4 * 73, "optimizer": 0}] * 3
    total = sum(p["parameters"] for p in per_rank) - 2 * 4 * 4  # sparse.scale counted once
    assert total == ddp[0]["parameters"]


def test_plan_shows_the_dense_bytes_per_rank():
    job = resolve_job(load_config(QUICKSTART, ["distributed.dense.strategy=fsdp", "train.dense_optimizer=adam"]))
    report = dry_run(job, 3, 3, "cpu")
    model = build_model(job.model, job.features.on(torch.device("meta")), job.train)
    assert report.dense["strategy"] == "fsdp"
    assert report.dense["per_rank"] == dense.planned_dense_bytes(model, "fsdp", 3, "adam")
    text = report.text()
    assert "dense tower: distributed.dense.strategy fsdp" in text and "not modelled" not in text
    ddp = dry_run(resolve_job(load_config(QUICKSTART)), 3, 3, "cpu")
    # The ledger: FSDP's all-gather and reduce-scatter of every block instead of DDP's all-reduce,
    # each rank's chunk padded on dim 0 (counted against a real run in tests/ranks/distributed/test_dense_fsdp.py)
    chunk = sum(-(-p.shape[0] // 3) * p[0].numel() * 4 for n, p in model.named_parameters() if "embedding" not in n)
    fsdp_t, ddp_t = report.ledger.per_table()["dense"], ddp.ledger.per_table()["dense"]
    assert fsdp_t["allreduce"] == 0 and ddp_t["allreduce"] == 3 * 4 * sum(
        p.numel() for n, p in model.named_parameters() if "embedding" not in n
    )
    assert fsdp_t["fsdp_all_gather"] == fsdp_t["fsdp_reduce_scatter"] == 3 * 2 * chunk
    assert ddp_t["fsdp_all_gather"] == ddp_t["fsdp_reduce_scatter"] == 0
    assert "fsdp gather" in text and "fsdp gather" not in ddp.text()
    assert ddp.dense["strategy"] == "ddp" and len({r["parameters"] for r in ddp.dense["per_rank"]}) == 1
    assert max(r["parameters"] for r in report.dense["per_rank"]) < ddp.dense["per_rank"][0]["parameters"] / 2


def test_global_norm_clipping_of_plain_tensors_is_torchs():
    torch.manual_seed(0)
    params = {f"p{i}": nn.Parameter(torch.randn(5, 3)) for i in range(3)}
    copies = [nn.Parameter(p.detach().clone()) for p in params.values()]
    for p, c in zip(params.values(), copies):
        p.grad = torch.randn(5, 3)
        c.grad = p.grad.clone()
    opt = GlobalNormClipping(KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(list(ps), lr=1.0)), 0.5)
    opt.step()
    torch.nn.utils.clip_grad_norm_(copies, 0.5)
    with torch.no_grad():
        for c in copies:
            c -= c.grad
    for p, c in zip(params.values(), copies):
        assert torch.equal(p.detach(), c.detach())


class Stacked(nn.Module):
    """Dense layers kept in containers (as HSTU keeps its layers): the containers have no forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 1)})
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(4))])
        self.emb = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
            device=torch.device("meta"),
        )


def test_containers_are_not_blocks_their_children_are():
    # fully_shard refuses a ModuleList/ModuleDict (no forward: FSDP's hooks would never run)
    blocks, rest = dense.dense_blocks(Stacked())
    assert blocks == ["layers.0.0", "layers.0.1", "heads.a"]
    assert rest == ["scales.0"]  # a parameter container's: replicated (DDP)


# Every zoo model in a shipped config (criteo: 13 dense + 26 ids; movielens: the schema's ids,
# bags and histories, no dense column).
ZOO = {
    "dlrm": ("criteo_quickstart.yaml", []),
    "dcnv2": ("criteo_dcnv2.yaml", []),
    "deepfm": ("criteo_deepfm.yaml", []),
    "wide_deep": ("criteo_wide_deep.yaml", []),
    "xdeepfm": ("criteo_xdeepfm.yaml", []),
    "din": ("movielens_din.yaml", []),
    "bst": ("movielens_bst.yaml", ["model.transformer_dropout=0.0"]),
    "hstu": ("movielens_hstu.yaml", ["model.layer_dropout=0.0"]),
    "mmoe": ("movielens_multitask.yaml", []),
    "ple": ("movielens_ple.yaml", []),
    "two_tower": ("movielens_two_tower.yaml", []),
    "deepfm_no_dense": ("movielens_deepfm.yaml", []),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_models_fsdp_blocks_are_called_and_trace_as_leaves(name):
    """Under fsdp a block's weights are gathered in its own forward hooks, and TorchRec's pipeline
    tracer (train.pipeline: sparse_dist) takes each block as a leaf whose output is opaque: every
    block ``dense_blocks`` picks must be called (not iterated) in a forward, and the model must
    trace with the blocks as leaves to the same logits. Before, BST (a Sequential iterated) and
    PLE (a level's list output iterated) failed every rank at their first fsdp step."""
    from torch.fx import GraphModule
    from torchrec import EmbeddingCollection
    from torchrec.distributed.train_pipeline.tracing import Tracer

    from tests.conftest import ROOT
    from tests.ranks.distributed.dense_worker import _movielens_batch
    from tests.ranks.distributed.equivalence import criteo_batch

    config, extra = ZOO[name]
    hashed = ["data.categorical_mapping=hash", "data.num_embeddings=200"] if "movielens" in config else []
    job = resolve_job(load_config(ROOT / "configs" / config, [*hashed, *extra]))
    torch.manual_seed(0)
    model = build_model(job.model, job.features.on(torch.device("cpu")), job.train).model.eval()
    if "movielens" in config:
        batch = _movielens_batch(0, 0, 1, job)
    else:
        batch = criteo_batch(torch.Generator().manual_seed(0), 8)
        batch.sparse_features = type(batch.sparse_features)(
            keys=batch.sparse_features.keys(),
            values=batch.sparse_features.values() % job.data.num_embeddings,
            lengths=batch.sparse_features.lengths(),
        )
    x, kjt = batch.dense_features, batch.sparse_features
    blocks, _ = dense.dense_blocks(model)
    called = set()
    for b in blocks:
        model.get_submodule(b).register_forward_pre_hook(lambda m, args, b=b: called.add(b))
    with torch.no_grad():
        want = model(x, kjt)
    assert called == set(blocks), (name, sorted(set(blocks) - called))
    tables = [n for n, m in model.named_modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    traced = GraphModule(model, Tracer(leaf_modules=[*tables, *blocks]).trace(model))
    with torch.no_grad():
        got = traced(x, kjt)
    for k in want if isinstance(want, dict) else [None]:
        torch.testing.assert_close(got[k] if k else got, want[k] if k else want, rtol=0, atol=0)
