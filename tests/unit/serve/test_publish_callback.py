"""PublishCallback: publishing leaves the training's random state as it was (the e2e check:
tests/e2e/models/test_hstu_cli.py::test_hstu_online_trains_each_partition_row_once_across_a_stop_and_publishes, with dropout)."""

import time
from types import SimpleNamespace

import torch

from recsys_dist.distributed.env import DistContext
from recsys_dist.serve import publish_callback
from recsys_dist.train.config import PublishConfig
from recsys_dist.train.observe import PhaseClock


class DrawingPublisher:
    """As the real Publisher does: builds (initialises) an unsharded model when it is made and
    when it publishes, drawing from the global RNG."""

    step = None

    def __init__(self, *args, **kwargs) -> None:
        torch.nn.Linear(8, 8)

    def publish(self, checkpoint, state):
        torch.nn.Linear(8, 8)
        return checkpoint


def test_publishing_does_not_move_the_training_random_state(tmp_path, monkeypatch):
    # Before, rank 0's model build drew from the RNG the dropout masks come from: a run resumed
    # after its first publish (which builds the model again) drew other masks.
    monkeypatch.setattr(publish_callback, "Publisher", DrawingPublisher)
    callback = publish_callback.PublishCallback(PublishConfig(enabled=True, every_n_steps=5), tmp_path)
    trainer = SimpleNamespace(
        clock=PhaseClock(time.time()),
        model=torch.nn.Linear(2, 1),
        resumed_at_step=None,
        step=5,
        ctx=DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo"),
    )
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    callback.on_checkpoint(trainer, 5, tmp_path)
    callback.on_checkpoint(trainer, 10, tmp_path)
    assert callback.publisher is not None  # it did publish (twice)
    assert torch.equal(torch.rand(4), want)
