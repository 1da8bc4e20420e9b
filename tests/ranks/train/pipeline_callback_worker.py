"""One rank of the 2-rank check that callbacks raising on EVERY rank at once, under
``distributed.dense.strategy: pipeline`` (2 stages: each rank holds one stage, the scoring pass
runs through both), stop every rank after saving the step, and ``resume="auto"`` ends with the
uninterrupted run's numbers: ``on_validation_end`` at a mid-epoch validation (step 8, after the
pipeline's scoring pass) and ``on_step_end`` at a plain step (6)."""

from __future__ import annotations

import os
from pathlib import Path

from recsys_dist.api import Trainer
from recsys_dist.config.loader import load_config
from recsys_dist.train.trainer import Callback
from tests.conftest import QUICKSTART
from tests.ranks.train.callback_failure_worker import OVERRIDES, _numbers, _raised

PIPELINE = ["distributed.dense.strategy=pipeline", "distributed.dense.stages=2"]


class RaiseAtValidation(Callback):
    def on_validation_end(self, trainer, step, metrics) -> None:
        if step == 8:
            raise ValueError(f"rank {trainer.ctx.rank}'s on_validation_end")


class RaiseAtStep(Callback):
    def on_step_end(self, trainer, step, loss) -> None:
        if step == 6:
            raise KeyError(f"rank {trainer.ctx.rank}'s on_step_end")


def raise_on_every_rank(rank: int, world_size: int, cache: str, out: str) -> dict:
    os.environ["RECSYS_DIST_CACHE"] = cache
    cfg = load_config(QUICKSTART, [*OVERRIDES, f"distributed.nproc_per_node={world_size}", *PIPELINE])
    got = {}
    for name, callback in (("validation", RaiseAtValidation()), ("step", RaiseAtStep())):
        run = Path(out) / name

        def fit(run=run, callback=callback) -> None:
            with Trainer(cfg, run, callbacks=[callback]) as trainer:
                trainer.fit()

        got[name] = _raised(fit)
        with Trainer(cfg, run, resume="auto") as trainer:
            got[f"{name}_resumed"] = (trainer.resumed_at_step, _numbers(trainer.fit()))
    with Trainer(cfg, Path(out) / "plain") as trainer:
        got["plain"] = _numbers(trainer.fit())
    return got
