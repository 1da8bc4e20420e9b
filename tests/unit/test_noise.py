"""Noise (issue 40, item 13): what every rank would say is said once per run (by rank 0), an
error never lands on the line a progress bar holds, and ``recsys-dist preprocess`` converts data
without importing torch, TorchRec or the model zoo."""

from __future__ import annotations

import io
import json
import logging
import sys
import warnings

import pytest
from tqdm import tqdm

from recsys_dist import logs


@pytest.fixture
def rank(monkeypatch):
    """Make this process rank N (``logs.set_rank``) for one test."""
    monkeypatch.setattr(logs, "_rank", None)
    monkeypatch.delenv("RANK", raising=False)

    def as_rank(n: int) -> None:
        logs.set_rank(n)

    return as_rank


def _handler_output(record_extra: dict | None = None) -> str:
    err = io.StringIO()
    logger = logging.getLogger("recsys_dist.test_noise")
    handler = logs.StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        saved, sys.stderr = sys.stderr, err
        try:
            logger.warning("partition p holds no rows", extra=record_extra)
        finally:
            sys.stderr = saved
    finally:
        logger.removeHandler(handler)
    return err.getvalue()


def test_log_lines_are_printed_by_rank_0_only(rank, monkeypatch):
    rank(0)
    assert _handler_output() == "WARNING partition p holds no rows\n"
    rank(1)
    assert _handler_output() == ""  # rank 0 says it for every rank
    # A record about this rank alone: printed, starting on a line of its own (rank 0 may hold a bar).
    assert _handler_output(logs.RANK_LOCAL) == "\nWARNING partition p holds no rows\n"
    # Under torchrun / launch the rank comes from the environment until the process group is made.
    monkeypatch.setattr(logs, "_rank", None)
    monkeypatch.setenv("RANK", "1")
    assert _handler_output() == ""


def test_python_warnings_are_shown_by_rank_0_only(rank):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown: list[str] = []
        warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
        rank(0)
        logs.show_warnings_on_main_rank_only()
        warnings.warn("on rank 0", UserWarning, stacklevel=1)
        rank(1)
        logs.show_warnings_on_main_rank_only()
        warnings.warn("on rank 1", UserWarning, stacklevel=1)
        assert shown == ["on rank 0"]
        warnings.simplefilter("error")  # the filters still act on every rank: an error stays an error
        with pytest.raises(UserWarning):
            warnings.warn("an error on rank 1", UserWarning, stacklevel=1)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_error_never_lands_on_a_progress_bars_line(monkeypatch):
    # This process's bar: cleared before the line and drawn again after it.
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = tqdm(total=10, desc="train", file=err, leave=False, mininterval=0)
    bar.update(3)
    logs.print_apart("recsys-dist: something failed")
    bar.close()
    lines = err.getvalue().split("\n")
    line = next(ln for ln in lines if "something failed" in ln)
    assert line.rpartition("\r")[2] == "recsys-dist: something failed", repr(err.getvalue())
    assert "train:" not in line.rpartition("\r")[2]
    # Another process's bar (rank 0's, seen from the launcher): a file or pipe gets a newline first ...
    err = io.StringIO("train:  31%|###       | 39/125")
    err.seek(0, io.SEEK_END)
    monkeypatch.setattr(sys, "stderr", err)
    logs.print_apart("recsys-dist: rank 0 was killed", other_bar=True)
    assert err.getvalue().split("\n")[1] == "recsys-dist: rank 0 was killed"
    # ... a terminal gets the bar's line cleared: back to its start, erased to its end.
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    logs.print_apart("recsys-dist: rank 0 was killed", other_bar=True)
    assert term.getvalue() == "\r\x1b[Krecsys-dist: rank 0 was killed\n"


def test_a_non_finite_loss_is_reported_once_not_by_every_rank():
    """Every rank sees the global window's non-finite loss and raises: the launcher reports it
    (``every_rank``), the ranks do not print it again (a 2-rank run printed it three times)."""
    import torch
    from torch import nn

    from recsys_dist.train.summary import divergence_error

    err = divergence_error([torch.tensor(float("nan"))], 7, nn.Linear(1, 1), None)
    assert err.every_rank is True and "non-finite training loss at step 7" in str(err)


def _undeclared(summary: dict, typed) -> set[str]:
    """Keys of ``summary`` (and of its ``best``) that the TypedDict ``typed`` does not name."""
    from recsys_dist.train.results import BestSummary

    extra = set(summary) - set(typed.__annotations__)
    if isinstance(summary.get("best"), dict):
        extra |= {f"best.{k}" for k in set(summary["best"]) - set(BestSummary.__annotations__)}
    return extra


def test_fit_summary_type_names_every_key_the_summary_holds(tmp_path):
    """``Trainer.fit()``'s summary as ``run_summary`` builds it (with a checkpoint and an early-stopping
    tracker: every optional key) and a resume's with nothing to train hold no key ``FitSummary``
    does not name, so mypy's view of ``fit()`` (a TypedDict, was ``dict``) is the real one."""
    from recsys_dist.checkpoint.run_dir import noop_summary
    from recsys_dist.train.early_stopping import BestTracker
    from recsys_dist.train.results import FitSummary
    from recsys_dist.train.summary import run_summary

    best = BestTracker("auc", patience=2)
    best.update({"auc": 0.7}, 10)
    metrics = {"auc": 0.7, "logloss": 0.5, "ne": 0.9, "calibration": 1.0, "num_examples": 100.0}
    wall = {"wall_seconds": 2.0, "wall_split": {"train": 1.5, "other": 0.5}}
    summary = run_summary(tmp_path, 2, 10, 640, 1.0, None, metrics, metrics, tmp_path / "ckpt", best, True, wall)
    assert {"checkpoint", "best", "test", "wall_split"} <= set(summary)
    assert _undeclared(summary, FitSummary) == set()
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert _undeclared(noop_summary(tmp_path, tmp_path / "ckpt", 10), FitSummary) == set()
