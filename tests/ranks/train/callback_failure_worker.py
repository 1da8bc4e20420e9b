"""One rank of the 2-rank callback-failure check (run via run_ranks): a callback raises in
``on_validation_end`` on rank 1 only, at a mid-epoch validation (step 8); then the run is
resumed (``resume="auto"``) and finished; then the uninterrupted run. Returns, per rank, what
each rank raised, and both summaries' numbers."""

from __future__ import annotations

import os
from pathlib import Path

from recsys_dist.api import Trainer
from recsys_dist.config.loader import load_config
from recsys_dist.train.trainer import Callback
from tests.cli import read_metrics
from tests.conftest import QUICKSTART

OVERRIDES = [
    "train.batch_size=64",
    "data.num_rows=2000",
    "train.epochs=2",
    "eval.every_n_steps=4",
    "train.log_every_n_steps=4",
    "train.progress_bar=false",
]


class RaiseOnRank(Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_validation_end(self, trainer, step, metrics) -> None:
        if trainer.ctx.rank == self.rank and step == self.step:
            raise ValueError(f"rank {self.rank}'s callback at step {step}")


def _numbers(summary: dict) -> tuple:
    return summary["steps"], summary["validation"], summary["test"]


def raise_on_one_rank(rank: int, world_size: int, cache: str, out: str) -> dict:
    os.environ["RECSYS_DIST_CACHE"] = cache
    cfg = load_config(QUICKSTART, [*OVERRIDES, f"distributed.nproc_per_node={world_size}"])
    run = Path(out) / "raised"
    raised = None
    try:
        with Trainer(cfg, run, callbacks=[RaiseOnRank(1, 8)]) as trainer:
            trainer.fit()
    except Exception as err:  # noqa: BLE001 - what this rank raised is the result
        raised = (type(err).__name__, str(err), list(getattr(err, "__notes__", [])))
    with Trainer(cfg, run, resume="auto") as trainer:
        resumed_at = trainer.resumed_at_step
        resumed = _numbers(trainer.fit())
    with Trainer(cfg, Path(out) / "plain") as trainer:
        plain = _numbers(trainer.fit())
    lines = None
    if rank == 0:
        lines = [
            [(r["split"], r["step"], r.get("auc"), r.get("loss")) for r in read_metrics(d)]
            for d in (run, Path(out) / "plain")
        ]
    return {"raised": raised, "resumed_at": resumed_at, "resumed": resumed, "plain": plain, "lines": lines}
