"""The Trainer is one class composed by role (issue 37 item 3): a data source, a step runner, a
recorder, a checkpointer; a StreamTrainer is that Trainer with the stream source, overriding
none of its methods; managed-collision metrics come from the model's own hooks."""

from __future__ import annotations

import inspect

import torch

from recsys_dist.distributed import comm_counter
from recsys_dist.models.managed import ManagedRemap
from recsys_dist.models.task import CTRTask
from recsys_dist.train import trainer as trainer_module
from recsys_dist.train.data_source import DataSource, EpochData
from recsys_dist.train.stream import StreamData, StreamTrainer
from recsys_dist.train.trainer import Trainer


def test_stream_trainer_is_the_trainer_with_a_stream_source():
    assert Trainer.__mro__[1:] == (object,)  # no loop mixin under it
    # (the unit tier's guard puts a refusing wrapper of Trainer.fit on both classes)
    own = {
        k
        for k, v in vars(StreamTrainer).items()
        if not k.startswith("__")
        and not (hasattr(Trainer, k) and inspect.unwrap(v) is inspect.unwrap(getattr(Trainer, k)))
    }
    # overrides no method of the Trainer but fit's return type (a StreamSummary), which calls it
    assert own <= {"source_type", "stream", "fit"}, own
    assert "super().fit()" in inspect.getsource(StreamTrainer.fit)
    assert Trainer.source_type is EpochData and StreamTrainer.source_type is StreamData
    for source in (EpochData, StreamData):
        assert issubclass(source, DataSource)
        for seam in ("setup", "run", "restore_position"):
            assert seam in vars(source), (source, seam)


def test_managed_metrics_come_from_the_model_hooks():
    # the trainer asks its CTRTask; nothing in it finds the remap by type or name
    text = inspect.getsource(trainer_module)
    assert "managed_metrics(self._model" not in text and "find_remap" not in text
    assert "_task.managed_metrics(" in text
    # the comm counter asks the remap whether it is issuing its all_gather, not the frame's name
    counter = inspect.getsource(comm_counter)
    assert "_gather_per_key" not in counter and "ManagedRemap.issuing_collective()" in counter
    assert ManagedRemap.issuing_collective() is False
    plain = CTRTask(torch.nn.Linear(1, 1))
    assert plain.managed_metrics("validation") == {} and plain.managed_counters() == {}
