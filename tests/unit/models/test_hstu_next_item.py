"""model.name: hstu_retrieval in one process: its outputs through CTRTask, its evaluator against
the library's evaluate_next_item on the same weights, its read_data's id-space check, and the
config checks."""

import dataclasses

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.data.loader import CTRBatch
from recsys_dist.models.build import build_model
from recsys_dist.models.hstu_retrieval import HSTURetrieval, evaluate_next_item, item_table
from recsys_dist.models.losses import in_batch_softmax
from recsys_dist.models.retrieval import Rows
from recsys_dist.models.zoo import hstu_next_item
from recsys_dist.models.zoo.hstu_next_item import NextItemData, next_item_metrics
from recsys_dist.train.preflight import check_sections, section_problems
from tests.conftest import ROOT

CONFIG = ROOT / "configs" / "movielens_hstu_retrieval.yaml"
ROWS = 60  # table rows of the small model


def _job(overrides, sizes=None):
    return resolve_job(load_config(CONFIG, ["distributed.nproc_per_node=1", *overrides]), sizes=sizes)


def small_model(counts=None):
    job = _job(["model.embedding_dim=8", "model.attention_dim=4", "model.linear_dim=4"], sizes=[ROWS, ROWS])
    spec = job.features.on(torch.device("cpu"))
    if counts is not None:
        spec = dataclasses.replace(spec, id_counts={"movieId": counts})
    torch.manual_seed(0)
    return job, build_model(job.model, spec, job.train)


def dense_copy(m, catalogue: np.ndarray, cfg) -> HSTURetrieval:
    """The library's HSTURetrieval with ``m``'s weights, its table cut to the catalogue: row j
    (1 .. C) = ``m``'s row ``catalogue[j - 1]``."""
    d = cfg.embedding_dim
    lib = HSTURetrieval(
        EmbeddingCollection(tables=[item_table(len(catalogue), d)]),
        d,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        attention_dim=cfg.attention_dim,
        linear_dim=cfg.linear_dim,
        dropout=cfg.layer_dropout,
        max_positions=cfg.max_positions,
    )
    lib.layers.load_state_dict(m.layers.state_dict())
    (weight,) = [p for n, p in m.seq_arch.named_parameters()]
    table = torch.zeros(len(catalogue) + 1, d)
    table[1:] = weight.detach()[torch.as_tensor(catalogue)]
    next(lib.seq_arch.parameters()).data.copy_(table)
    return lib


def test_outputs_through_ctr_task_match_user_and_item_vectors_and_logq():
    counts = np.arange(ROWS, dtype=np.int64)
    job, task = small_model(counts)
    m = task.model
    assert m.keys == ["movieId", "history"] and len(list(m.seq_arch.parameters())) == 1  # one shared table
    # 3 rows: items 5, 6, 6; histories [1, 2], [3], [] (a first event)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["movieId", "history"], torch.tensor([5, 6, 6, 1, 2, 3]), torch.tensor([1, 1, 1, 2, 1, 0], dtype=torch.int32)
    )
    m.eval()
    out = m(torch.zeros(3, 0), kjt)
    u = m.user_vectors([np.array([1, 2]), np.array([3])])
    v = m.item_vectors(np.array([5, 6, 6]))
    temp = job.model.temperature
    assert torch.allclose(out["candidate_scores"][:2], u @ v.T / temp, atol=1e-5)
    assert torch.allclose(out["logits"][:2], (u * v[:2]).sum(1) / temp, atol=1e-5)
    assert torch.equal(out["candidate_ids"], torch.tensor([5, 6, 6]))
    want_q = np.log(np.maximum(counts, 1) / counts.sum())[[5, 6, 6]]
    assert np.allclose(out["candidate_log_q"].numpy(), want_q, atol=1e-6)
    labels, weights = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 0.0])
    loss, _ = task(CTRBatch(torch.zeros(3, 0), kjt, labels, weights))
    want = in_batch_softmax(
        out["logits"], labels, weights, out["candidate_scores"], out["candidate_ids"], out["candidate_log_q"]
    )
    assert torch.allclose(loss, want)


@pytest.mark.parametrize("batch_size", [3, 256])
def test_evaluator_equals_the_library_evaluate_on_the_same_weights(batch_size):
    job, task = small_model()
    m = task.model
    rng = np.random.default_rng(0)
    catalogue = np.sort(rng.choice(np.arange(1, ROWS), size=25, replace=False))  # sparse table ids
    histories = [rng.choice(catalogue, size=rng.integers(1, 8), replace=False) for _ in range(11)]
    targets = rng.choice(catalogue, size=11)
    counts = np.bincount(rng.choice(catalogue, size=200), minlength=ROWS)
    data = NextItemData(catalogue, counts, "movieId", {"test": histories}, {"test": targets}, {"test": 2})
    job = dataclasses.replace(job, eval=job.eval.model_copy(update={"batch_size": batch_size}))
    got = next_item_metrics(m, data, "test", job, torch.device("cpu"))
    assert next_item_metrics(m, data, "validation", job, torch.device("cpu")) == {}
    dense = [np.searchsorted(catalogue, h) + 1 for h in histories]
    lib = dense_copy(m, catalogue, job.model)
    want = evaluate_next_item(lib, dense, np.searchsorted(catalogue, targets) + 1, len(catalogue), ks=(10, 50))
    for k in ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "mrr"):
        assert got[k] == pytest.approx(want[k], abs=1e-9), k
    assert got["mrr"] < 1 and got["next_item_rows"] == 11 and got["next_item_skipped"] == 2 and got["catalogue"] == 25
    # most popular: item counts as the score, the history excluded, ties to the lower id
    pop = []
    for h, t in zip(histories, targets):
        cand = [c for c in catalogue if c == t or c not in set(h)]
        pop.append(1 + sum(counts[c] > counts[t] or (counts[c] == counts[t] and c < t) for c in cand))
    assert got["popular_mrr"] == pytest.approx(np.mean(1 / np.array(pop)))


def test_read_data_refuses_a_history_outside_the_item_ids(monkeypatch):
    job, _ = small_model()
    items = {"train": [3, 4, 5], "validation": [5], "test": [4]}
    history = {"train": ([0, 1, 1], [3, 4]), "validation": ([2], [3, 4]), "test": ([1], [9])}  # 9: no row's item

    def rows(files, features):
        (s,) = files
        lengths, values = (np.asarray(x, np.int64) for x in history[s])
        return Rows(
            {"movieId": (np.ones(len(items[s]), np.int64), np.asarray(items[s])), "history": (lengths, values)},
            np.zeros(len(items[s]), np.float32),
        )

    monkeypatch.setattr(hstu_next_item, "read_rows", rows)
    paths = {s: [s] for s in items}
    with pytest.raises(ValueError, match="test split's history holds id 9, which no row's movieId has"):
        hstu_next_item.read_next_item_data(job, paths)
    history["test"] = ([0], [])  # a row without history is skipped
    data = hstu_next_item.read_next_item_data(job, paths)
    assert data.catalogue.tolist() == [3, 4, 5] and data.train_counts[[3, 4, 5]].tolist() == [1, 1, 1]
    assert [h.tolist() for h in data.histories["validation"]] == [[3, 4]] and data.targets["validation"].tolist() == [5]
    assert data.histories["test"] == [] and data.skipped == {"validation": 0, "test": 1}


def test_config_problems():
    assert section_problems(_job([])) == []
    for overrides, match in [
        (["data.categorical_mapping=vocabulary"], "data.categorical_mapping: hstu_retrieval reads the item and its"),
        (["data.schema.categorical=[movieId,userId]"], r"data.schema: hstu_retrieval reads the item 'movieId' and"),
        (["train.loss=bce"], "train.loss: hstu_retrieval trains with in-batch candidates"),
        (["data.num_embeddings=[1000,2000]"], "data.num_embeddings: the item and history tables must have one size"),
        (["data.schema.history=null"], "data.schema.history: hstu_retrieval reads one user history"),
    ]:
        with pytest.raises(ConfigError, match=match):
            check_sections(_job(overrides))
    with pytest.raises(ConfigError, match="deep_layer_sizes"):  # an option the model does not take
        _job(["model.deep_layer_sizes=[8]"])
