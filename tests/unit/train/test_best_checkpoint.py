"""Issue 17 "Keeping the best model": train.early_stopping and checkpoint.keep_best.

The slow test trains MovieLens DeepFM (the shipped config, 2 ranks) for 3 epochs, validating
every 25 steps: it overfits after the first epoch (validation logloss best at step 125), stops
after 3 validations without improvement, keeps the best checkpoint although checkpoint.keep is 1,
scores the test split with its weights (restore_best), and `predict best` / `evaluate best` score it. A run killed mid-way and resumed leaves the same
metrics lines, early stop and best checkpoint.
"""

import logging
import math

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.early_stopping import BestTracker
from recsys_dist.train.preflight import check_sections
from tests.conftest import QUICKSTART


def test_best_tracker_directions_min_delta_patience():
    t = BestTracker("logloss", patience=2, min_delta=0.01)
    assert t.update({"logloss": 0.5}, 1) and t.best == 0.5
    assert not t.update({"logloss": 0.495}, 2)  # better, but by less than min_delta
    assert not t.stopped and t.update({"logloss": 0.48}, 3) and t.best_step == 3 and t.bad == 0
    assert not t.update({"logloss": 0.49}, 4) and not t.update({"logloss": 0.485}, 5) and t.stopped
    resumed = BestTracker("logloss", patience=5, min_delta=0.01)
    resumed.load(t.state())
    assert (resumed.best, resumed.best_step, resumed.bad, resumed.stopped) == (0.48, 3, 2, False)
    auc = BestTracker("auc")
    assert auc.update({"auc": 0.7}, 1) and not auc.update({"auc": 0.6}, 2) and auc.update({"auc": 0.71}, 3)
    assert not auc.stopped  # no patience: only tracks the best


def test_undefined_metric_neither_improves_nor_counts_towards_patience(caplog):
    t = BestTracker("auc", patience=2)
    with caplog.at_level(logging.WARNING, logger="recsys_dist"):
        # A one-class / empty validation split: AUC is null (None or NaN), never a best (keep_best
        # saves only on an improvement) and never a step towards the stop.
        for step, m in enumerate([{"auc": None}, {"auc": math.nan}, {}, {"auc": None}], 1):
            assert not t.update(m, step)
    assert (t.best, t.best_step, t.bad, t.stopped) == (None, None, 0, False)
    assert sum("undefined" in r.getMessage() for r in caplog.records) == 1  # warned once
    assert t.update({"auc": 0.6}, 5) and t.best_step == 5
    assert not t.update({"auc": None}, 6) and not t.update({"auc": 0.55}, 7) and t.bad == 1 and not t.stopped
    assert not t.update({"auc": 0.59}, 8) and t.stopped


def test_keep_best_needs_checkpoints():
    with pytest.raises(ConfigError, match="checkpoint.keep_best"):
        check_sections(resolve_job(load_config(QUICKSTART, ["checkpoint.keep_best=true", "checkpoint.enabled=false"])))
    with pytest.raises(ConfigError, match="train.early_stopping"):
        load_config(QUICKSTART, ["train.early_stopping={metric: recall, patience: 0}"])
