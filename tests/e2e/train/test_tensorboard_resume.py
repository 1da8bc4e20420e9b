"""Issue 17 item 5: a resumed run purges the TensorBoard events after its checkpoint
(``SummaryWriter(purge_step=step + 1)``), so the re-trained steps show once.

tensorboard is optional (and absent from the test environment): a stand-in
``torch.utils.tensorboard`` module records how the writer was made.
"""

import sys
import types

from recsys_dist.api import Trainer
from recsys_dist.config.loader import load_config
from tests.conftest import QUICKSTART


class FakeWriter:
    made: list = []

    def __init__(self, log_dir, **kwargs):
        FakeWriter.made.append((log_dir, kwargs))
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, step))

    def flush(self):
        pass

    def close(self):
        pass


def test_resume_purges_tensorboard_events_after_the_checkpoint(tmp_path, monkeypatch, cache_dir):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    cfg = load_config(
        QUICKSTART,
        [
            "data.num_rows=600",
            "data.num_embeddings=1000",
            "distributed.nproc_per_node=1",
            "train.batch_size=64",
            "train.max_steps=4",
            "train.progress_bar=false",
            "checkpoint.every_n_steps=2",
        ],
    )
    run = tmp_path / "run"
    with Trainer(cfg, run) as trainer:
        trainer.fit()
    assert FakeWriter.made[-1] == (str(run / "tensorboard"), {})
    with Trainer(cfg, run, resume=run / "checkpoints" / "step_00000002") as trainer:
        assert trainer.step == 2
    assert FakeWriter.made[-1] == (str(run / "tensorboard"), {"purge_step": 3})
