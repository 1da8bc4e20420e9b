"""Issue 40 item 10: after early stopping, the test split is scored (and the final checkpoint saved,
and predict run) with the best validation's weights, not the last, overfit ones
(``train.early_stopping.restore_best``, the default); ``restore_best: false`` keeps the last.
Item 12: patience in epochs or rows, so that a validation every few steps does not stop a run
after a fixed number of steps.

The runs overfit the quickstart's data (2,000 rows, 25 steps an epoch, validated every 10 steps):
the validation logloss is best in the first epoch and rises after it, so patience runs out.
"""

import json
import logging
import shutil

import pytest

import recsys_dist
from recsys_dist.cli.report import report
from recsys_dist.config.loader import load_config
from recsys_dist.train.summary import print_summary, summary_metrics
from tests.cli import read_metrics
from tests.conftest import QUICKSTART
from tests.unit.train.test_restore_best import OVERFIT, _environment, fit, scored, validations

ONE_RANK = [*OVERFIT, "distributed.nproc_per_node=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The overfitting run (restore_best, the default) and the same with restore_best: false:
    ``{name: (run_dir, summary, evaluate("test"), evaluate("validation"))}``, and the cache."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        _environment(mp, root / "cache")
        out = {"cache": root / "cache"}
        for name, extra in (("best", []), ("last", ["train.early_stopping.restore_best=false"])):
            out[name] = (root / name, *fit([*ONE_RANK, *extra], root / name))
        return out


@pytest.fixture
def no_launcher(monkeypatch, runs):
    _environment(monkeypatch, runs["cache"])


def test_early_stopping_scores_and_saves_the_best_validation_weights(tmp_path, runs, no_launcher, capsys):
    run, summary, test, val = runs["best"]
    best, steps = summary["best"], summary["steps"]
    lines = validations(run)
    # Overfit, then stopped: the best validation is earlier than the last step.
    assert best["early_stopped"] and best["step"] == min(lines, key=lambda s: lines[s]["logloss"]) < steps
    assert lines[steps]["logloss"] > lines[best["step"]]["logloss"] + 0.05
    # The summary's numbers are the best step's weights', and say so.
    assert summary["weights_step"] == best["step"]
    assert summary["validation"] == lines[best["step"]] == summary_metrics(val)
    assert summary_metrics(test) == summary["test"]  # the Trainer holds those weights after fit()
    assert json.loads((run / "summary.json").read_text())["test"] == summary["test"]
    # metrics.jsonl's test line: trained to the last step, scored the best step's weights; the
    # report sets the validation of those weights beside it.
    (test_line,) = read_metrics(run, "test")
    assert test_line["step"] == steps and test_line["weights_step"] == best["step"]
    text = report(run, plots=False)
    val_row = next(l for l in text.splitlines() if l.strip().startswith("validation "))
    assert val_row.split()[1:4] == [
        str(best["step"]),
        f"{lines[best['step']]['auc']:.4f}",
        f"{lines[best['step']]['logloss']:.4f}",
    ]
    assert f"the weights of step {best['step']}, the best validation's" in text
    print_summary(summary)
    assert f"scored: the weights of step {best['step']}, the best validation's (restored; trained to step {steps})" in (
        capsys.readouterr().out
    )
    # Exactly what the best step's checkpoint scores, and the final checkpoint holds them too
    # (checkpoint.keep 1: the best one is kept all the same).
    best_dir = run / "checkpoints" / f"step_{best['step']:08d}"
    assert best["checkpoint"] == str(best_dir) and summary["checkpoint"] == str(
        run / "checkpoints" / f"step_{steps:08d}"
    )
    assert scored(ONE_RANK, tmp_path / "eval_best", best_dir) == summary["test"]
    assert scored(ONE_RANK, tmp_path / "eval_final", summary["checkpoint"]) == summary["test"]

    # A resume after the run finished trains nothing and reports the same numbers.
    again, _, _ = fit(ONE_RANK, run, resume="auto")
    assert again["already_complete"] and again["test"] == summary["test"]
    assert again["weights_step"] == best["step"]

    # restore_best: false keeps the last weights: the same training, other test numbers.
    last_run, last, last_test, _ = runs["last"]
    assert validations(last_run) == lines and last["best"]["step"] == best["step"]
    assert last["weights_step"] == last["steps"] == steps and last["validation"] == lines[steps]
    assert last["test"] == summary_metrics(last_test) and last["test"]["logloss"] > summary["test"]["logloss"] + 0.05
    # Checkpoints off: the best weights kept in memory give the same numbers to the last bit.
    memory, _, _ = fit([*ONE_RANK, "checkpoint.enabled=false"], tmp_path / "memory")
    assert memory["weights_step"] == best["step"] and memory["test"] == summary["test"]
    assert not (tmp_path / "memory" / "checkpoints").exists()


class RemoveAfterLoad(recsys_dist.Callback):
    """Deletes a directory at the first step (the checkpoint resumed from, once loaded)."""

    def __init__(self, path) -> None:
        self.path = path

    def on_step_end(self, trainer, step, loss) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def test_a_resumed_run_restores_the_best_weights_of_the_run_it_continues(tmp_path, runs, no_launcher, caplog):
    run, summary, _, _ = runs["best"]
    best = run / "checkpoints" / f"step_{summary['best']['step']:08d}"
    # Resumed from the best checkpoint into another run directory: the same steps, the same stop,
    # and the best weights read from the checkpoint directory it was resumed from.
    resumed, _, _ = fit(ONE_RANK, tmp_path / "resumed", resume=best)
    assert resumed["resumed_at_step"] == summary["best"]["step"]
    assert (resumed["steps"], resumed["weights_step"], resumed["test"]) == (
        summary["steps"],
        summary["weights_step"],
        summary["test"],
    )
    meta = json.loads((tmp_path / "resumed" / "checkpoints" / f"step_{summary['steps']:08d}" / "meta.json").read_text())
    assert meta["weights_step"] == summary["weights_step"] and meta["early_stopping"]["stopped"]
    # The best checkpoint gone before the end: said, and the last weights scored (and named).
    copy = tmp_path / "copy" / "checkpoints" / best.name
    shutil.copytree(best, copy)
    cfg = load_config(QUICKSTART, ONE_RANK)
    with caplog.at_level(logging.WARNING, logger="recsys_dist"):
        with recsys_dist.Trainer(cfg, tmp_path / "lost", resume=copy, callbacks=[RemoveAfterLoad(copy)]) as trainer:
            lost = trainer.fit()
    last = runs["last"][1]
    assert lost["weights_step"] == lost["steps"] == summary["steps"] and lost["test"] == last["test"]
    assert f"the checkpoint of the best validation (step {summary['best']['step']}) is in none of" in caplog.text
