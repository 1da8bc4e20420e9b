"""benchmarks/run.py's pieces: the hardware-limit arithmetic, the plain-PyTorch DLRM, the ``bench``
subcommand, its refusals and (slow) its MLPerf path through its command line, and one tiny growth
point on a spawned rank. The harness itself: tests/unit/benchmarks/test_harness.py."""

from __future__ import annotations

import pytest
import torch

from benchmarks import baselines, growth


@pytest.mark.slow
def test_one_tiny_growth_point():
    from recsys_dist.testing import run_ranks

    res = run_ranks(growth.sweep, 1, [100], [8], 100, 8, 0.05, timeout_s=240)[0]
    (point,) = res["rows"]
    assert point["samples_per_s"] > 0 and point["peak_rss_mb"] >= point["base_rss_mb"] > 0
    assert res["batch"][0]["batch"] == 8


def hook_vs_native(rank: int, world: int) -> float:
    """run_ranks target: 5 Adagrad steps of a sparse EmbeddingBag + Linear in DDP, averaged by
    gloo's sparse all-reduce and by ``sparse_allgather_hook``; max weight difference."""
    from torch import nn

    weights = []
    for hook in (False, True):
        torch.manual_seed(0)
        model = nn.ModuleDict({"e": nn.EmbeddingBag(50, 16, mode="sum", sparse=True), "l": nn.Linear(16, 1)})

        class Wrap(nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, ids):
                return self.m["l"](self.m["e"](ids)).squeeze(1)

        ddp = torch.nn.parallel.DistributedDataParallel(Wrap(model))
        if hook:
            ddp.register_comm_hook(None, baselines.sparse_allgather_hook)
        opt = torch.optim.Adagrad(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(5):
            opt.zero_grad()
            ddp(torch.randint(0, 50, (8, 1), generator=g)).pow(2).mean().backward()
            opt.step()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])


@pytest.mark.slow
def test_plain_baselines_sparse_hook_averages_as_ddp_does():
    from recsys_dist.testing import run_ranks

    assert run_ranks(hook_vs_native, 2, timeout_s=240) == [0.0, 0.0]


@pytest.mark.slow
def test_one_tiny_mlperf_growth_point():
    from recsys_dist.testing import run_ranks

    res = run_ranks(growth.sweep, 1, [100], [8], 100, 8, 0.05, True, "cpu", timeout_s=240)[0]
    (point,) = res["rows"]
    assert point["samples_per_s"] > 0 and point["table_mb"] == growth.TABLES * 100 * 129 * 4 / 2**20
