import pytest
import torch

from recsys_dist.train.schedule import LRSchedule


def test_warmup_then_polynomial_decay_then_hold():
    s = LRSchedule(warmup_steps=4, decay_start_step=10, decay_steps=4)
    assert [s.scale(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.scale(9) == 1.0
    assert [s.scale(i) for i in (10, 11, 12, 13, 14, 20)] == [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    s.apply(opt, [0.1], 14)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-7)  # floored at min_lr
    assert not LRSchedule().active
