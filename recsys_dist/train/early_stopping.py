"""The best validation score so far, for ``train.early_stopping`` and ``checkpoint.keep_best``.

Every rank holds an identical :class:`BestTracker`: validation metrics are global (the same
on every rank), so every rank reaches the same decision at the same step without a
collective. Its state goes into each checkpoint's ``meta.json``, so a resumed run stops
where the uninterrupted one would.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger("recsys_dist")

HIGHER_IS_BETTER = {"auc": True, "logloss": False, "ne": False}


class BestTracker:
    """Best value of one validation metric, its step and metrics, the validations since it
    improved, and the stop.

    Args:
        metric: ``auc`` (higher is better), ``logloss`` or ``ne`` (lower is better).
        patience: stop after this many validations in a row without an improvement (None:
            never stop, only track the best).
        min_delta: an improvement is a change in the better direction larger than this.
        patience_steps: count patience in training steps instead (``train.early_stopping``
            with ``patience_unit`` epochs or rows, converted by the Trainer): stop at the first
            validation without an improvement that comes this many steps or more after the best
            one; ``patience`` is then unused.

    Attributes:
        best: the best value so far (None before the first finite one); best_step: its step;
        best_metrics: every validation metric of that step (what ``evaluate`` returned).
        bad: validations since the last improvement; last_step: the step of the latest
        validation with a defined metric. stopped: patience ran out.
    """

    def __init__(
        self, metric: str, patience: int | None = None, min_delta: float = 0.0, patience_steps: int | None = None
    ) -> None:
        if metric not in HIGHER_IS_BETTER:
            raise ValueError(f"metric must be one of {sorted(HIGHER_IS_BETTER)}, got {metric!r}")
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        self.patience_steps = patience_steps
        self.best: float | None = None
        self.best_step: int | None = None
        self.best_metrics: dict = {}
        self.bad = 0
        self.last_step: int | None = None
        self.stopped = False
        self._warned = False

    def update(self, metrics: dict, step: int) -> bool:
        """Record the validation ``metrics`` of ``step``; True when they are a new best.

        A missing or non-finite value (e.g. AUC of a one-class or empty validation split) is
        undefined: neither an improvement nor a validation without one (it does not count
        towards ``patience``); the first is logged as a warning."""
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            if not self._warned:
                self._warned = True
                log.warning(
                    "validation %s is undefined at step %d (e.g. a one-class or empty validation split); "
                    "it neither improves nor counts towards early-stopping patience",
                    self.metric,
                    step,
                )
            return False
        if self.best is None:
            better = True
        else:
            gain = value - self.best if HIGHER_IS_BETTER[self.metric] else self.best - value
            better = gain > self.min_delta
        self.last_step = step
        if better:
            self.best, self.best_step, self.bad = float(value), step, 0
            self.best_metrics = dict(metrics)
        else:
            self.bad += 1
            self.stopped = self._out_of_patience()
        return better

    def _out_of_patience(self) -> bool:
        if self.bad == 0:
            return False
        if self.patience_steps is not None:
            return self.best_step is not None and self.last_step - self.best_step >= self.patience_steps
        return self.patience is not None and self.bad >= self.patience

    def state(self) -> dict:
        """JSON-ready state (for ``meta.json``)."""
        return {
            "metric": self.metric,
            "best": self.best,
            "best_step": self.best_step,
            "best_metrics": self.best_metrics,
            "bad": self.bad,
            "last_step": self.last_step,
            "stopped": self.stopped,
        }

    def load(self, state: dict | None) -> None:
        """Continue from :meth:`state` of a checkpoint (a checkpoint without one: a fresh start).
        A checkpoint that tracked another metric starts the tracking afresh."""
        if not state or state.get("metric") != self.metric:
            return
        self.best, self.best_step, self.bad = state["best"], state["best_step"], int(state["bad"])
        self.best_metrics = dict(state.get("best_metrics") or {})
        self.last_step = state.get("last_step", self.best_step)
        # Decided by this run's patience: a resume with a larger one continues training.
        self.stopped = self._out_of_patience()
