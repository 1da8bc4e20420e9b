"""model.name: sasrec_retrieval from the shipped retrieval config: it builds (the HSTU-only keys
of the file left out), refuses an HSTU-only key given for it, checks its history length, and one
training step through CTRTask moves the loss and the shared table as hstu_retrieval's path does."""

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.config import ConfigError
from recsys_dist.data.loader import CTRBatch
from recsys_dist.models.build import build_model
from recsys_dist.models.losses import in_batch_softmax
from recsys_dist.models.sasrec_retrieval import SASRecRetrieval
from recsys_dist.models.zoo.hstu_next_item import NextItemData, next_item_metrics
from recsys_dist.models.zoo.sasrec_next_item import SASRecNextItem
from recsys_dist.train.preflight import check_sections, coverage_problems, section_problems
from tests.unit.models.test_hstu_next_item import ROWS, _job

SASREC = ["model.name=sasrec_retrieval", "model.embedding_dim=8", "model.num_heads=2"]


def test_builds_from_the_shipped_config_and_refuses_hstu_keys():
    job = _job(SASREC, sizes=[ROWS, ROWS])
    assert job.model.name == "sasrec_retrieval" and job.model.item_id == "movieId"
    assert job.model.layer_dropout == 0.2 and job.model.max_length == 200  # the file's dropout kept
    assert section_problems(job) == []
    assert coverage_problems(job) == []  # positions: a parameter, not an nn.Embedding no sharder covers
    torch.manual_seed(0)
    m = build_model(job.model, job.features.on(torch.device("cpu")), job.train).model
    assert isinstance(m, SASRecNextItem) and isinstance(m, SASRecRetrieval)
    assert len(m.blocks) == 2 and len(m.layers) == 0 and m.positions.shape == (200, 8)
    assert len(list(m.seq_arch.parameters())) == 1  # one table: the item and the history read it
    meta = build_model(job.model, job.features.on(torch.device("meta"), torch.device("meta")), job.train).model
    assert {p.device.type for n, p in meta.named_parameters() if "seq_arch" not in n} == {"meta"}  # on spec.device
    for key in ("model.attention_dim=4", "model.max_positions=32", "model.linear_dim=4"):
        with pytest.raises(ConfigError, match=key.split("=")[0].split(".")[1]):
            _job([*SASREC, key])
    with pytest.raises(ConfigError, match="num_heads=3 must divide model.embedding_dim=8"):
        _job([*SASREC[:2], "model.num_heads=3"])
    for overrides, match in [
        (["model.max_length=20"], "model.max_length: 20 positions, fewer than data.schema.history.max_length 50"),
        (["data.categorical_mapping=vocabulary"], "data.categorical_mapping: sasrec_retrieval reads the item"),
        (["train.loss=bce"], "train.loss: sasrec_retrieval trains with in-batch candidates"),
    ]:
        with pytest.raises(ConfigError, match=match):
            check_sections(_job([*SASREC, *overrides]))


def test_one_training_step_and_the_evaluator():
    job = _job([*SASREC, "model.layer_dropout=0"], sizes=[ROWS, ROWS])
    torch.manual_seed(0)
    task = build_model(job.model, job.features.on(torch.device("cpu")), job.train)
    m = task.model
    # 4 rows: items 5, 6, 7, 8; histories [1, 2], [3], [], [5, 6, 7]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["movieId", "history"],
        torch.tensor([5, 6, 7, 8, 1, 2, 3, 5, 6, 7]),
        torch.tensor([1, 1, 1, 1, 2, 1, 0, 3], dtype=torch.int32),
    )
    batch = CTRBatch(torch.zeros(4, 0), kjt, torch.ones(4), torch.ones(4))
    out = m(torch.zeros(4, 0), kjt)
    # The user vectors are SASRec's encoder's: y_n of each history.
    u = m.user_vectors([np.array([1, 2]), np.array([3]), np.array([5, 6, 7])])
    v = m.item_vectors(np.array([5, 6, 8]))
    temp = job.model.temperature
    assert torch.allclose(out["logits"][[0, 1, 3]], (u * v).sum(1) / temp, atol=1e-5)
    loss, _ = task(batch)
    want = in_batch_softmax(
        out["logits"],
        batch.labels,
        batch.weights,
        out["candidate_scores"],
        out["candidate_ids"],
        out["candidate_log_q"],
    )
    assert torch.allclose(loss, want)
    params = list(task.parameters())
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1e-3)
    opt.zero_grad()
    loss.backward()
    blocks = [p.grad for p in m.blocks.parameters() if p.grad is not None]
    assert blocks and all(torch.isfinite(g).all() for g in blocks)
    opt.step()
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, m.blocks.parameters(), strict=False))
    assert task(batch)[0] < loss  # one step down the loss
    # The shared evaluator reads the SASRec model (it finds HSTUNextItem's subclass).
    data = NextItemData(
        np.arange(1, 10),
        np.ones(ROWS, np.int64),
        "movieId",
        {"test": [np.array([1, 2])]},
        {"test": np.array([5])},
        {"test": 0},
    )
    metrics = next_item_metrics(m, data, "test", job, torch.device("cpu"))
    assert metrics["next_item_rows"] == 1 and 0 < metrics["mrr"] <= 1 and metrics["catalogue"] == 9


def test_traces_as_the_training_pipeline_does():
    """TrainPipelineSparseDist traces the forward (the table is a leaf): the graph gives the
    model's outputs (a shape read by the position ids in plain code failed the trace)."""
    from torch.fx import GraphModule
    from torchrec.distributed.train_pipeline.tracing import Tracer

    job = _job(SASREC, sizes=[ROWS, ROWS])
    torch.manual_seed(0)
    m = build_model(job.model, job.features.on(torch.device("cpu")), job.train).model.eval()
    traced = GraphModule(m, Tracer(leaf_modules=["seq_arch"]).trace(m))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["movieId", "history"], torch.tensor([5, 6, 1, 2, 3]), torch.tensor([1, 1, 2, 1], dtype=torch.int32)
    )
    dense = torch.zeros(2, 0)
    torch.testing.assert_close(traced(dense, kjt), m(dense, kjt), rtol=0, atol=0)
