"""One rank of the mid-epoch validation check (run via run_ranks): the DIN and BST templates
(a sharded EmbeddingCollection for the history), and DeepFM (EmbeddingBagCollection only),
trained for 30 steps with a validation every 10 steps (eval batch 256, train batch 64), once
under ``train.pipeline: base`` (the reference) and once under ``sparse_dist``; a callback also
scores the validation split after step 15 (inside the pipelined loop, between validations).
Returns rank 0's metrics.jsonl records and the callback's metrics per run."""

from __future__ import annotations

import os
from pathlib import Path

from recsys_dist.api import Trainer
from recsys_dist.config.loader import load_config
from recsys_dist.train.trainer import Callback
from tests.cli import read_metrics

ROOT = Path(__file__).resolve().parents[3]
OVERRIDES = [
    "train.max_steps=30",
    "eval.every_n_steps=10",
    "train.log_every_n_steps=5",
    "train.progress_bar=false",
    "train.timing_every_n_steps=null",
    "checkpoint.enabled=false",
    "checkpoint.keep_best=false",
]


class EvaluateAtStep15(Callback):
    def __init__(self) -> None:
        self.metrics = None

    def on_step_end(self, trainer, step, loss) -> None:
        if step == 15:
            self.metrics = trainer.evaluate("validation")


def train_both_pipelines(rank: int, world_size: int, cache: str, out: str) -> dict:
    os.environ["RECSYS_DIST_CACHE"] = cache
    runs = {}
    for model in ("din", "bst", "deepfm"):
        for pipeline in ("base", "sparse_dist"):
            cfg = load_config(
                ROOT / "configs" / f"movielens_{model}.yaml",
                [*OVERRIDES, f"train.pipeline={pipeline}", f"distributed.nproc_per_node={world_size}"],
            )
            run_dir = Path(out) / f"{model}-{pipeline}"
            callback = EvaluateAtStep15()
            with Trainer(cfg, run_dir, callbacks=[callback]) as trainer:
                trainer.fit()
            runs[f"{model}-{pipeline}"] = (read_metrics(run_dir), callback.metrics) if rank == 0 else None
    return runs
