"""A user's typed script against the public API, checked by mypy in tests/e2e/api/test_typing.py
(never run: it would train). Every call here must type-check as written."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import recsys_dist


class PrintLoss(recsys_dist.Callback):
    def on_step_end(self, trainer: recsys_dist.Trainer, step: int, loss: torch.Tensor) -> None:
        if step % 100 == 0:
            print(step, float(loss))


def with_trainer(config: str, run_dir: Path) -> float:
    cfg: recsys_dist.RunConfig = recsys_dist.load_config(config, ["train.epochs=1"])
    spec: recsys_dist.FeatureSpec = recsys_dist.feature_spec(cfg)
    names: list[str] = spec.sparse_names
    with recsys_dist.Trainer(
        cfg,
        run_dir,
        resume="auto",
        dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        callbacks=[PrintLoss()],
    ) as trainer:
        summary: recsys_dist.FitSummary = trainer.fit()
        test: dict[str, float] = trainer.evaluate("test")
        checkpoint: Path = trainer.save_checkpoint()
        step: int = trainer.step
    # The summary's keys as docs/api.md and Trainer.fit document them, with their types.
    test_auc: float | None = summary["test"]["auc"]
    trained: int = summary["steps"] + summary["rows_trained"]
    if "best" in summary:
        best_step: int | None = summary["best"]["step"]
        print(best_step, summary["best"]["metric"], summary["best"]["early_stopped"])
    print(summary["run_dir"], summary["wall_split"]["train"], summary.get("checkpoint"), test_auc, trained)
    print(names, checkpoint, step)
    return test["auc"]


def streamed(config: str, run_dir: str) -> recsys_dist.StreamSummary:
    with recsys_dist.StreamTrainer(recsys_dist.load_config(config), run_dir, resume="auto") as trainer:
        return trainer.fit()


def own_loop(model: nn.Module, run_dir: str) -> int:
    dmp = recsys_dist.shard(model, {"sharding_types": ["row_wise"]}, seed=0)
    optimizer = torch.optim.Adam(dmp.parameters(), lr=1e-3)
    path: Path = recsys_dist.save_checkpoint(run_dir, dmp, optimizer, step=10, extra={"epoch": 0})
    latest: Path | None = recsys_dist.latest_checkpoint(Path(run_dir))
    resumed = recsys_dist.load_checkpoint(latest or path, dmp, optimizer)
    epoch: int = resumed.extra["epoch"]
    return resumed.step + epoch


def launched() -> list[float]:
    summaries = recsys_dist.launch(streamed, 2, "configs/criteo_online.yaml", "runs/py_online")
    partitions: list[str] = summaries[0]["partitions"]
    stopped: str | None = summaries[0]["stopped"]
    print(partitions, stopped)
    return recsys_dist.launch(with_trainer, 2, "configs/criteo_quickstart.yaml", Path("runs/typed"))
