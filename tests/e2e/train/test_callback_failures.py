"""A user callback's on_validation_end, one rank in this process: an exception it raises loses
no training (a checkpoint of the step, or the finished run's files, then the exception with the
callback named), and editing the metrics it gets changes neither metrics.jsonl nor the summary.
The same on 2 ranks, raised on one: tests/ranks/train/test_callback_failures.py."""

from __future__ import annotations

import json

import pytest

import recsys_dist
from tests.cli import read_metrics
from tests.conftest import QUICKSTART

OVERRIDES = [
    "distributed.nproc_per_node=1",
    "train.batch_size=64",
    "data.num_rows=2000",
    "train.progress_bar=false",
    "train.epochs=2",  # 25 steps each
]


class RaiseAt(recsys_dist.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_end(self, trainer, step, metrics):
        if step == self.step:
            raise ValueError(f"user callback at step {step}")


class Edit(recsys_dist.Callback):
    def on_validation_end(self, trainer, step, metrics):
        metrics["auc"] = -1.0
        metrics["mine"] = 1.0
        del metrics["logloss"]


def untimed(run) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in ("samples_per_s", "seconds") and not k.endswith("_ms")}
        for r in read_metrics(run)
    ]


def numbers(summary: dict) -> tuple:
    return summary["steps"], summary["validation"], summary["test"], summary["checkpoint"].rsplit("/", 1)[-1]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The uninterrupted run without callbacks: (its run directory, its summary)."""
    tmp = tmp_path_factory.mktemp("plain")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECSYS_DIST_CACHE", str(tmp / "cache"))
        with recsys_dist.Trainer(recsys_dist.load_config(QUICKSTART, OVERRIDES), tmp / "run") as trainer:
            summary = trainer.fit()
    assert summary["steps"] == 50 and summary["validation"]["auc"] > 0.5
    return tmp / "run", summary


def test_a_callback_editing_its_metrics_changes_no_number_of_the_run(tmp_path, cache_dir, plain):
    # Before: the summary's and metrics.jsonl's validation had auc -1, no logloss, a key "mine".
    with recsys_dist.Trainer(recsys_dist.load_config(QUICKSTART, OVERRIDES), tmp_path, callbacks=[Edit()]) as trainer:
        assert numbers(trainer.fit()) == numbers(plain[1])
    assert untimed(tmp_path) == untimed(plain[0])
    assert json.loads((tmp_path / "summary.json").read_text())["validation"] == plain[1]["validation"]


def test_a_callback_raising_at_validation_loses_no_training(tmp_path, cache_dir, plain):
    cfg = recsys_dist.load_config(QUICKSTART, OVERRIDES)
    # Raised at the first epoch's end: the step is saved, then the exception, its callback named;
    # resume="auto" ends with the uninterrupted run's numbers. Before: no checkpoint of the
    # epoch (the resume trained it again from scratch) and no note.
    run = tmp_path / "raised"
    with recsys_dist.Trainer(cfg, run, callbacks=[RaiseAt(25)]) as trainer:
        with pytest.raises(ValueError, match="user callback at step 25") as err:
            trainer.fit()
    assert (run / "checkpoints" / "step_00000025" / "meta.json").is_file()
    note = " ".join(getattr(err.value, "__notes__", []))
    assert "raised by callback RaiseAt.on_validation_end at step 25 on rank(s) 0; every rank stopped" in note
    assert f"the run's state at step 25 is in checkpoint {run / 'checkpoints' / 'step_00000025'}" in note
    assert "continue with resume='auto'" in note
    assert [r["step"] for r in read_metrics(run, "validation")] == [25]  # its line was written
    with recsys_dist.Trainer(cfg, run, resume="auto") as trainer:
        assert trainer.resumed_at_step == 25
        assert numbers(trainer.fit()) == numbers(plain[1])
    assert untimed(run) == untimed(plain[0])

    # Raised at the run's last validation: the run finishes first (test split, final checkpoint,
    # summary.json: were all missing), then the exception.
    run = tmp_path / "last"
    with recsys_dist.Trainer(cfg, run, callbacks=[RaiseAt(50)]) as trainer:
        with pytest.raises(ValueError, match="user callback at step 50") as err:
            trainer.fit()
    assert numbers(json.loads((run / "summary.json").read_text())) == numbers(plain[1])
    assert "in checkpoint " + str(run / "checkpoints" / "step_00000050") in " ".join(err.value.__notes__)
    assert untimed(run) == untimed(plain[0])


class RaiseAtStep(recsys_dist.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step, loss):
        if step == self.step:
            raise ValueError(f"user callback at step {step}")


@pytest.mark.parametrize("at", [10, 25])
def test_a_callback_raising_at_step_end_loses_no_training(tmp_path, cache_dir, plain, at):
    """``on_step_end`` raising: mid-epoch (10), the step is saved and the exception raised with
    its callback and hook named; at the epoch's last step (25), after the epoch's validation line
    and checkpoint. resume="auto" ends with the uninterrupted run's numbers and lines. Before:
    the exception left fit() with no checkpoint of the step (steps 1-10 trained again, or the
    whole epoch lost)."""
    cfg = recsys_dist.load_config(QUICKSTART, OVERRIDES)
    run = tmp_path / "raised"
    with recsys_dist.Trainer(cfg, run, callbacks=[RaiseAtStep(at)]) as trainer:
        with pytest.raises(ValueError, match=f"user callback at step {at}") as err:
            trainer.fit()
    checkpoint = run / "checkpoints" / f"step_{at:08d}"
    assert (checkpoint / "meta.json").is_file()
    note = " ".join(getattr(err.value, "__notes__", []))
    assert f"raised by callback RaiseAtStep.on_step_end at step {at} on rank(s) 0; every rank stopped" in note
    assert f"the run's state at step {at} is in checkpoint {checkpoint}: continue with resume='auto'" in note
    assert [r["step"] for r in read_metrics(run, "validation")] == ([25] if at == 25 else [])
    with recsys_dist.Trainer(cfg, run, resume="auto") as trainer:
        assert trainer.resumed_at_step == at
        assert numbers(trainer.fit()) == numbers(plain[1])
    assert untimed(run) == untimed(plain[0])
