"""PLE (Tang et al., RecSys 2020): eq. 2-5 against a plain reference loop; CGC keeps each task
off the other tasks' experts; configs/movielens_ple.yaml builds and trains a step."""

from pathlib import Path

import pytest
import torch

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.models.build import build_model
from tests.unit.models.test_mmoe import _batch

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "movielens_ple.yaml"


def _task(*overrides):
    cfg = load_config(CONFIG, ["data.num_embeddings=50", "data.categorical_mapping=hash", *overrides])
    torch.manual_seed(0)
    job = resolve_job(cfg)
    task = build_model(job.model, job.features.on(torch.device("cpu")), job.train)
    task.eval()
    return task


def reference(m, x):
    """PLE written out from the paper, level by level, with explicit softmax weights."""
    T = len(m.towers)
    g = [x] * (T + 1)  # task inputs, then the shared input
    for level in m.levels:
        shared = [e(g[T]) for e in level.shared_experts]
        new = []
        for k in range(T):
            own = [e(g[k]) for e in level.task_experts[k]]
            w = torch.softmax(level.task_gates[k](g[k]), dim=1)  # eq. 3: m_k + m_s weights
            S = own + shared  # eq. 2: task k's own experts, then the shared ones
            new.append(sum(w[:, i : i + 1] * S[i] for i in range(len(S))))
        if level.shared_gate is not None:  # below the top: a gate over every expert of the level
            every = [e(g[k]) for k in range(T) for e in level.task_experts[k]] + shared
            w = torch.softmax(level.shared_gate(g[T]), dim=1)
            new.append(sum(w[:, i : i + 1] * every[i] for i in range(len(every))))
        g = new
    return torch.cat([m.towers[k](g[k]) for k in range(T)], dim=1)  # eq. 5


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_ple_follows_the_equations(levels):
    task = _task(f"model.num_levels={levels}")
    m, batch = task.model, _batch()
    assert len(m.levels) == levels and [lv.shared_gate is None for lv in m.levels] == [False] * (levels - 1) + [True]
    with torch.no_grad():  # the levels' weights are random; make the gates far from uniform
        for lv in m.levels:
            for gate in [*lv.task_gates, *([lv.shared_gate] if lv.shared_gate is not None else [])]:
                gate.weight.mul_(20)
    loss, (_, logits, labels, _) = task(batch)
    assert logits.shape == (8, 2) and labels.shape == (8, 2)
    pooled = m.sparse_arch(batch.sparse_features)
    x = torch.cat([pooled[f] for f in m.features], dim=1)
    torch.testing.assert_close(logits, reference(m, x))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0])
    mse = ((logits[:, 1] - labels[:, 1]) ** 2).mean()
    torch.testing.assert_close(loss, bce + 0.1 * mse)


def test_cgc_task_ignores_the_other_tasks_experts():
    # One level (CGC): task 0's logit reads only its own and the shared experts, so changing
    # task 1's experts moves task 1's logit alone.
    task = _task("model.num_levels=1")
    batch = _batch()
    before = task(batch)[1][1]
    with torch.no_grad():
        for p in task.model.levels[0].task_experts[1].parameters():
            p.add_(1.0)
    after = task(batch)[1][1]
    torch.testing.assert_close(after[:, 0], before[:, 0])
    assert (after[:, 1] - before[:, 1]).abs().max() > 1e-3


def test_ple_trains_a_step_and_reports_per_task_losses():
    task = _task()
    task.train()
    opt = torch.optim.Adagrad(task.parameters(), lr=0.05)
    batch = _batch(32)
    loss, (logged, *_) = task(batch)
    assert loss.dim() == 0 and logged.shape == (3,)  # the total, then like's and rating's own losses
    torch.testing.assert_close(logged[0], logged[1] + 0.1 * logged[2])
    loss.backward()
    opt.step()
    # every expert and gate is on a path to a logit (level 0's shared gate via level 1's shared experts)
    assert [n for n, p in task.named_parameters() if p.grad is None] == []


def test_ple_config_checks():
    # The messages, not just the key: an unknown-key error names the key too.
    with pytest.raises(ConfigError, match=r"model\.num_levels: Input should be greater than 0"):
        load_config(CONFIG, ["model.num_levels=0"])
    with pytest.raises(ConfigError, match=r"model\.tower_sizes must be positive ints, got \[0\]"):
        load_config(CONFIG, ["model.tower_sizes=[0]"])


def test_ple_traces_with_its_fsdp_blocks_as_leaves():
    """Under distributed.dense.strategy: fsdp TorchRec's pipeline tracer (train.pipeline:
    sparse_dist) takes each FSDP block (``dense.dense_blocks``: here each CGC level and tower) as a
    leaf, whose output is one opaque value: the graph must still give the model's logits. Before,
    PLE iterated the last level's output (a list of per-task tensors), which a leaf's output cannot
    be: every rank failed at the first step (torch.fx ``TraceError: Proxy object cannot be iterated``)."""
    from torch.fx import GraphModule
    from torchrec.distributed.train_pipeline.tracing import Tracer

    from recsys_dist.distributed.dense import dense_blocks

    m, batch = _task("model.num_levels=2").model, _batch()
    blocks, _ = dense_blocks(m)
    assert {"levels.0", "levels.1"} <= set(blocks), blocks
    graph = Tracer(leaf_modules=["sparse_arch", *blocks]).trace(m)
    dense, kjt = batch.dense_features, batch.sparse_features
    torch.testing.assert_close(GraphModule(m, graph)(dense, kjt), m(dense, kjt), rtol=0, atol=0)
