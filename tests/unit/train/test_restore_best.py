"""Issue 40 item 12 without a run: patience in epochs or rows counts training since the best, and the
history templates wait an epoch past it; also the overfitting run (OVERFIT, fit, scored) the
restore-best tests of tests/ranks and tests/e2e share.
"""

import pytest

import recsys_dist
from recsys_dist.config.loader import load_config
from recsys_dist.train.build import best_tracker
from recsys_dist.train.early_stopping import BestTracker
from recsys_dist.train.summary import summary_metrics
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


def _environment(mp: pytest.MonkeyPatch, cache) -> None:
    mp.setenv("RECSYS_DIST_CACHE", str(cache))
    for name in LAUNCHER_ENV:
        mp.delenv(name, raising=False)


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


@pytest.mark.parametrize("name", ["movielens_din", "movielens_bst", "movielens_hstu"])
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
