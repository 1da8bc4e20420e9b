"""One rank of the 2-rank callback-failure check (run via run_ranks): a callback raises in
``on_validation_end`` on rank 1 only, at a mid-epoch validation (step 8); then the run is
resumed (``resume="auto"``) and finished; then the uninterrupted run. The same with
``on_step_end`` raising at step 4 (a validation step) in a callback only rank 1 has, and with
``on_partition_end`` raising on rank 1 after a stream's first partition. Returns, per rank,
what each rank raised, and the summaries' numbers."""

from __future__ import annotations

import os
from pathlib import Path

from recsys_dist.api import StreamTrainer, Trainer
from recsys_dist.config.loader import load_config
from recsys_dist.train.trainer import Callback
from tests.cli import read_metrics
from tests.conftest import QUICKSTART
from tests.unit.train.test_stream import CONFIG, NAMES, land, overrides

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


class RaiseAtStepEnd(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step, loss) -> None:
        if step == self.step:
            raise ValueError(f"rank {trainer.ctx.rank}'s on_step_end at step {step}")


class RaiseAfterPartition(Callback):
    def __init__(self, rank: int, partition: str) -> None:
        self.rank, self.partition = rank, partition

    def on_partition_end(self, trainer, partition, checkpoint) -> None:
        if trainer.ctx.rank == self.rank and partition == self.partition:
            raise ValueError(f"rank {self.rank}'s on_partition_end after {partition}")


def _raised(fn) -> tuple | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - what this rank raised is the result
        return (type(err).__name__, str(err), list(getattr(err, "__notes__", [])))
    return None


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
    step_end = _step_end_on_one_rank(rank, cfg, Path(out) / "step_end")
    lines = None
    if rank == 0:
        lines = [
            [(r["split"], r["step"], r.get("auc"), r.get("loss")) for r in read_metrics(d)]
            for d in (run, Path(out) / "plain", Path(out) / "step_end")
        ]
    stream = _partition_end_on_one_rank(rank, Path(out) / "stream")
    return {
        "raised": raised,
        "resumed_at": resumed_at,
        "resumed": resumed,
        "plain": plain,
        "lines": lines,
        "step_end": step_end,
        "stream": stream,
    }


def _step_end_on_one_rank(rank: int, cfg, run: Path) -> dict:
    """Only rank 1 has the callback (the ranks agree that steps are checked); it raises at step 4."""

    def fit() -> None:
        with Trainer(cfg, run, callbacks=[RaiseAtStepEnd(4)] if rank == 1 else []) as trainer:
            trainer.fit()

    raised = _raised(fit)
    with Trainer(cfg, run, resume="auto") as trainer:
        return {"raised": raised, "resumed_at": trainer.resumed_at_step, "resumed": _numbers(trainer.fit())}


def _partition_end_on_one_rank(rank: int, out: Path) -> dict:
    landing, run = out / "landing", out / "run"
    if rank == 0:
        for name in NAMES[:2]:
            land(landing, name)
    cfg = load_config(CONFIG, [*overrides(landing), "publish.enabled=false", "publish.every_partition=false"])

    def fit() -> None:
        with StreamTrainer(cfg, run, callbacks=[RaiseAfterPartition(1, NAMES[0])]) as trainer:
            trainer.fit()

    raised = _raised(fit)
    with StreamTrainer(cfg, run, resume="auto") as trainer:
        resumed_at = trainer.resumed_at_step
        summary = trainer.fit()
    parts = [(r["partition"], r["rows"]) for r in read_metrics(run, "partition")] if rank == 0 else None
    return {"raised": raised, "resumed_at": resumed_at, "partitions": summary["partitions"], "parts": parts}
