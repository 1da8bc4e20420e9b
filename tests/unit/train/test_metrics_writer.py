import json
import sys
import types

from recsys_dist.train.metrics_writer import MetricsWriter


def test_jsonl_nan_to_null_and_tensorboard_mirror(tmp_path, monkeypatch):
    scalars = []

    class FakeWriter:
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def flush(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    w = MetricsWriter(tmp_path / "metrics.jsonl", enabled=True)
    w.write(split="validation", step=3, epoch=0, auc=float("nan"), logloss=0.5)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "split": "validation",
        "step": 3,
        "epoch": 0,
        "auc": None,
        "logloss": 0.5,
    }
    assert scalars == [("validation/logloss", 0.5, 3)]
    MetricsWriter(tmp_path / "other.jsonl", enabled=False).write(split="train", step=1, epoch=0, loss=1.0)
    assert not (tmp_path / "other.jsonl").exists()
