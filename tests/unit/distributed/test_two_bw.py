"""``recsys_dist.distributed.two_bw.TwoBW`` in one process, around a stand-in schedule: the
update is W(t+1) = W(t) - lr * grad f(W(t-1)) with W(-1) = W(0), the parameters hold W(t)
between steps (also after a failed step), and a checkpoint without W(t-1) restarts the delay
from the loaded weights. The distributed checks: tests/ranks/distributed/test_two_bw.py."""

import pytest
import torch
from torch import nn

from recsys_dist.distributed.two_bw import STALE_KEY, TwoBW, fit_to_checkpoint, stale_state


class Schedule:
    """One stage's whole step: the loss of a batch and its backward (as a torch schedule's step)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.fail = False

    def step(self, x, target):
        loss = ((self.module(x) - target) ** 2).mean()
        loss.backward()
        if self.fail:
            raise RuntimeError("a rank died")
        return loss.detach()


def _data(t: int):
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)


def _grad(weights: dict, t: int) -> dict:
    """grad f(weights) on batch t, by hand on a copy."""
    w = {k: v.clone().requires_grad_() for k, v in weights.items()}
    x, y = _data(t)
    ((x @ w["weight"].T + w["bias"] - y) ** 2).mean().backward()
    return {k: v.grad for k, v in w.items()}


def test_the_update_is_one_version_stale():
    torch.manual_seed(0)
    layer = nn.Linear(3, 1)
    two_bw = TwoBW(Schedule(layer), dict(layer.named_parameters()))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    now = {k: v.detach().clone() for k, v in layer.named_parameters()}
    before = dict(now)  # W(-1) = W(0)
    for t in range(5):
        opt.zero_grad()
        two_bw.step(*_data(t))
        g = _grad(before, t)
        # after the step the parameters are W(t) (not the version it ran on) and their grad is grad f(W(t-1))
        for k, p in layer.named_parameters():
            assert torch.equal(p, now[k]) and torch.allclose(p.grad, g[k], atol=1e-7)
        opt.step()
        for k, p in layer.named_parameters():
            assert torch.allclose(p, now[k] - 0.1 * g[k], atol=1e-7)  # W(t+1) = W(t) - lr grad f(W(t-1))
        before, now = now, {k: v.detach().clone() for k, v in layer.named_parameters()}
    assert all(torch.equal(s, before[k]) for k, s in stale_state(_Model(two_bw))[STALE_KEY].items())


def test_a_failed_step_leaves_the_current_weights():
    layer = nn.Linear(3, 1)
    schedule = Schedule(layer)
    two_bw = TwoBW(schedule, dict(layer.named_parameters()))
    two_bw.step(*_data(0))
    with torch.no_grad():
        layer.weight += 1.0  # W(1) != W(0)
    current = layer.weight.detach().clone()
    schedule.fail = True
    with pytest.raises(RuntimeError, match="a rank died"):
        two_bw.step(*_data(1))
    assert torch.equal(layer.weight, current)


class _Model(nn.Module):
    def __init__(self, two_bw):
        super().__init__()
        self.dense_stages = type("Stages", (), {"schedule": two_bw})()


def test_a_checkpoint_without_the_previous_version_restarts_the_delay():
    layer = nn.Linear(3, 1)
    two_bw = TwoBW(Schedule(layer), dict(layer.named_parameters()))
    model = _Model(two_bw)
    two_bw.step(*_data(0))
    saved = {f"{STALE_KEY}.weight", f"{STALE_KEY}.bias", "model.x"}
    state = {"model": {}, **stale_state(model)}
    fit_to_checkpoint(model, state, saved)
    assert STALE_KEY in state and not two_bw.fresh  # the load fills W(t-1) in place
    fit_to_checkpoint(model, state, {"model.x", f"{STALE_KEY}.weight"})  # a name missing: a ddp or 1f1b one
    assert STALE_KEY not in state and two_bw.fresh
    with torch.no_grad():
        layer.weight.fill_(2.0)  # the loaded weights
    two_bw.step(*_data(1))  # runs on them: W(-1) = the loaded W(t)
    assert torch.equal(two_bw.stale[0], layer.weight.detach())
    plain = nn.Linear(3, 1)
    assert stale_state(plain) == {}
    state = {"model": {}}
    fit_to_checkpoint(plain, state, set())
    assert state == {"model": {}}
