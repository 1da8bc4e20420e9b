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
from recsys_dist.train.build import best_tracker
from recsys_dist.train.early_stopping import BestTracker
from recsys_dist.train.summary import print_summary, summary_metrics
from tests.cli import read_metrics
from tests.conftest import QUICKSTART, ROOT

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
OVERFIT = [
    "data.num_rows=2000",
    "train.epochs=8",
    "train.batch_size=64",
    "train.embedding_lr=0.05",
    "train.dense_lr=0.05",
    "train.progress_bar=false",
    "train.log_every_n_steps=5",
    "eval.every_n_steps=10",
    "checkpoint.keep=1",
    "train.early_stopping={metric: logloss, patience: 3}",
]
ONE_RANK = [*OVERFIT, "distributed.nproc_per_node=1"]


def _environment(mp: pytest.MonkeyPatch, cache) -> None:
    mp.setenv("RECSYS_DIST_CACHE", str(cache))
    for name in LAUNCHER_ENV:
        mp.delenv(name, raising=False)


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


def fit(overrides: list, run_dir, resume=None) -> tuple[dict, dict, dict]:
    """A run's summary, then evaluate("test") and evaluate("validation") of the Trainer after fit()."""
    with recsys_dist.Trainer(load_config(QUICKSTART, overrides), run_dir, resume=resume) as trainer:
        summary = trainer.fit()
        return summary, trainer.evaluate("test"), trainer.evaluate("validation")


def scored(overrides: list, run_dir, checkpoint) -> dict:
    """evaluate("test") of a checkpoint, loaded by a new Trainer in another run directory."""
    with recsys_dist.Trainer(load_config(QUICKSTART, overrides), run_dir, resume=checkpoint) as trainer:
        return summary_metrics(trainer.evaluate("test"))


def validations(run_dir) -> dict[int, dict]:
    return {m["step"]: summary_metrics(m) for m in read_metrics(run_dir, "validation")}


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


def two_rank_job(overrides: list, root: str) -> dict:
    """Every rank: the run with sharded tables, the best and final checkpoints scored again,
    and the run with checkpoints off."""
    summary, test, _ = fit(overrides, root + "/run")
    best = summary["best"]["checkpoint"]
    return {
        "summary": summary,
        "test": summary_metrics(test),
        "best": scored(overrides, root + "/eval_best", best),
        "final": scored(overrides, root + "/eval_final", summary["checkpoint"]),
        "memory": fit([*overrides, "checkpoint.enabled=false"], root + "/memory")[0],
    }


@pytest.mark.slow
def test_two_ranks_with_sharded_tables_restore_the_best_weights(tmp_path, monkeypatch):
    _environment(monkeypatch, tmp_path / "cache")  # the ranks inherit it
    overrides = [*OVERFIT, "distributed.nproc_per_node=2", "train.batch_size=32", "sharding.sharding_types=[row_wise]"]
    ours, other = recsys_dist.launch(two_rank_job, 2, overrides, str(tmp_path))
    summary = ours["summary"]
    assert summary["best"]["early_stopped"] and summary["weights_step"] == summary["best"]["step"] < summary["steps"]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert {row["sharding_type"] for row in plan} == {"row_wise"} and all(row["ranks"] == [0, 1] for row in plan)
    for o in (ours, other):
        assert o["test"] == o["best"] == o["final"] == summary["test"]
        assert o["memory"]["test"] == summary["test"] and o["memory"]["weights_step"] == summary["weights_step"]


def test_patience_in_epochs_or_rows_counts_training_since_the_best():
    # Validations every 25 steps, 125 steps an epoch (the DIN template's schedule): best at 100.
    aucs = {25: 0.60, 50: 0.65, 75: 0.66, 100: 0.67, 125: 0.66, 150: 0.665, 175: 0.66, 200: 0.66, 225: 0.65}
    in_validations = BestTracker("auc", patience=4)
    in_steps = BestTracker("auc", patience=1, patience_steps=125)
    stopped = {}
    for step, auc in aucs.items():
        for name, t in (("validations", in_validations), ("steps", in_steps)):
            t.update({"auc": auc}, step)
            if t.stopped and name not in stopped:
                stopped[name] = step
    assert stopped == {"validations": 200, "steps": 225}  # 4 validations (100 steps), or one epoch
    resumed = BestTracker("auc", patience=1, patience_steps=125)
    resumed.load(in_steps.state())
    assert resumed.stopped and resumed.best_step == 100 and resumed.best_metrics == {"auc": 0.67}
    larger = BestTracker("auc", patience=2, patience_steps=250)
    larger.load(in_steps.state())
    assert not larger.stopped  # a resume with more patience trains on

    def tracker(unit: str, patience: int) -> BestTracker:
        cfg = load_config(QUICKSTART, [f"train.early_stopping={{patience: {patience}, patience_unit: {unit}}}"])
        return best_tracker(cfg, steps_per_epoch=125, global_batch=128)

    assert tracker("epochs", 2).patience_steps == 250
    assert tracker("rows", 1000).patience_steps == 8  # ceil(1000 / 128): at least 1,000 rows
    assert tracker("validations", 4).patience_steps is None


@pytest.mark.parametrize("name", ["movielens_din", "movielens_bst"])
def test_history_templates_wait_an_epoch_past_the_best(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    es = cfg.train.early_stopping
    assert (es.patience, es.patience_unit, es.restore_best) == (1, "epochs", True)
    steps_per_epoch = 16_000 // (cfg.train.batch_size * cfg.distributed.nproc_per_node)
    t = best_tracker(cfg, steps_per_epoch, cfg.train.batch_size * cfg.distributed.nproc_per_node)
    t.update({"auc": 0.7}, 100)
    for step in range(125, 225, cfg.eval.every_n_steps):  # 4 validations without a better AUC: going on
        t.update({"auc": 0.69}, step)
    assert not t.stopped
    t.update({"auc": 0.69}, 225)
    assert t.stopped
