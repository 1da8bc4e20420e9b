"""``recsys_dist.save_checkpoint`` / ``load_checkpoint`` of an own loop, in one process (no
process group): the model and a torch optimizer's lazily made state come back exactly; bad
arguments are refused naming the problem. (2 ranks and a sharded model: examples/own_loop,
tests/e2e/examples/test_examples.py.)"""

import pytest
import torch
from torch import nn

import recsys_dist
from recsys_dist.errors import CheckpointError


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def test_a_model_and_its_adam_state_come_back(tmp_path):
    model, opt = trained(3)
    path = recsys_dist.save_checkpoint(tmp_path, model, opt, step=3, extra={"epoch": 1, "batch": 7})
    assert path == tmp_path / "checkpoints" / "step_00000003"
    assert recsys_dist.latest_checkpoint(tmp_path) == path

    fresh, fresh_opt = trained(0)  # other weights, no Adam state yet
    resumed = recsys_dist.load_checkpoint(tmp_path, fresh, fresh_opt)
    assert (resumed.step, resumed.world_size, resumed.extra) == (3, 1, {"epoch": 1, "batch": 7})
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][k], fresh_opt.state[b][k]), k
    # Both continue alike.
    x = torch.randn(16, 4)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    # It holds no config: export / load_model refuse it by name (not a KeyError deep inside).
    from recsys_dist.errors import CheckpointError
    from recsys_dist.serve.export import load

    with pytest.raises(CheckpointError, match="loop of your own"):
        load(path)


def test_bad_arguments_are_refused(tmp_path):
    model, opt = trained(1)
    with pytest.raises(ValueError, match="extra must be JSON-serialisable"):
        recsys_dist.save_checkpoint(tmp_path, model, opt, step=1, extra={"t": torch.zeros(1)})
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"optimizer holds a parameter of shape \(8, 4\) that is not a parameter"):
        recsys_dist.save_checkpoint(tmp_path, other, opt, step=1)
    with pytest.raises(ValueError, match="step must be >= 0"):
        recsys_dist.save_checkpoint(tmp_path, model, opt, step=-1)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        recsys_dist.load_checkpoint(tmp_path, model, opt)
    recsys_dist.save_checkpoint(tmp_path, model, opt, step=1)
    wider = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 1))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        recsys_dist.load_checkpoint(tmp_path, wider)
