"""A run's summary: the dict :meth:`Trainer.fit` returns (and writes as ``summary.json``), and
the lines ``recsys-dist train`` prints from it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from recsys_dist.checkpoint import run_dir as run_dirs
from recsys_dist.checkpoint.meta import best_checkpoint
from recsys_dist.distributed.ledger import run_ledger
from recsys_dist.distributed.pipeline_traffic import add_pipeline_flows, pipeline_layout
from recsys_dist.models.build import build_model
from recsys_dist.models.registry import GIVEN_MODEL
from recsys_dist.train.early_stopping import BestTracker
from recsys_dist.train.job import Job
from recsys_dist.train.metrics_writer import finite_or_none

log = logging.getLogger("recsys_dist")


def train_window(
    losses: list[torch.Tensor], real_rows: list[torch.Tensor], world_size: int, task_names: list[str]
) -> tuple[float, dict[str, float], int]:
    """The global mean loss of a logging window, its per-task means (``loss/<task>``, several
    tasks) and the rows trained in it over all ranks; one all_reduce.

    ``losses``: each step's loss (a scalar, or ``[1 + T]``: the total, then each task's);
    ``real_rows``: each step's sample weights ``[B]`` (rows with weight > 0 count)."""
    real = (torch.cat(real_rows) > 0).float().sum()  # rows, not the sum of their sample weights
    means = torch.stack(losses).float().mean(dim=0).reshape(-1)
    stats = torch.cat([means, real.reshape(1)]).cpu()
    if world_size > 1:
        dist.all_reduce(stats)
    per_task = {}
    if len(means) > 1:
        per_task = {f"loss/{n}": float(v) / world_size for n, v in zip(task_names, stats[1:-1])}
    return float(stats[0]) / world_size, per_task, int(stats[-1])


def divergence_error(losses: list[torch.Tensor], step: int, model: nn.Module, good: Path | None) -> FloatingPointError:
    """The error of a window whose loss became non-finite: its first bad step, the first
    non-finite parameter and ``good``, the last good checkpoint (checkpoints are only written
    after a finite window)."""
    local = torch.stack(losses).float()
    local = local.reshape(len(local), -1)[:, 0]  # the total (several tasks: [1 + T] a step)
    bad = torch.nonzero(~torch.isfinite(local)).flatten()
    first = step - len(local) + 1 + (int(bad[0]) if len(bad) else 0)
    # This rank's values only (a DTensor's local shard): no collective on an error path.
    mine = ((n, p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters())
    param = next((n for n, p in mine if not torch.isfinite(p).all()), None)
    err = FloatingPointError(
        f"non-finite training loss at step {first} (steps {step - len(local) + 1}-{step} checked "
        f"together); first non-finite parameter: {param or 'none (the loss itself overflowed)'}; "
        f"last good checkpoint: {good or 'none'}. Lower train.embedding_lr / train.dense_lr"
        + (", then continue with --resume auto." if good else " and start again.")
    )
    err.every_rank = True  # type: ignore[attr-defined]  # the window's loss is global: every rank raises it
    return err


def log_early_stop(best: BestTracker, step: int) -> None:
    log.info(
        "early stopping at step %d: validation %s has not improved for %d validations (best %.6g at step %s)",
        step,
        best.metric,
        best.bad,
        best.best if best.best is not None else float("nan"),
        best.best_step,
    )


def ledger_line(job: Job, model: nn.Module, world_size: int) -> dict:
    """The bytes one step moves (``recsys_dist.distributed.ledger``), as plain JSON values; under
    ``distributed.dense.strategy: pipeline`` with the stages' collectives
    (``recsys_dist.distributed.pipeline_traffic``) of a registered or import-path model (a
    ``Trainer(model=...)`` model's are left out: its widths are read from a meta build)."""
    led = run_ledger(model, job.data, job.sharding.comms, job.train.batch_size, world_size)
    if getattr(model, "dense_stages", None) is not None and world_size > 1 and job.model_spec is not GIVEN_MODEL:
        meta = build_model(job.model, job.features.on(torch.device("meta")), job.train)
        f, groups = job.features, job.sharding.replica_groups
        layout, _ = pipeline_layout(meta, job.distributed.dense, world_size, f.num_dense, f.keys, groups)
        if layout is not None:
            add_pipeline_flows(led, layout)
    return json.loads(json.dumps(finite_or_none(led.to_dict())))


def run_summary(
    run_dir: Path,
    world_size: int,
    steps: int,
    rows_trained: int,
    train_seconds: float,
    resumed_at_step: int | None,
    validation: dict,
    test: dict,
    checkpoint: Path | None,
    best: BestTracker | None,
    keep_best: bool,
    wall: dict,
    weights_step: int | None = None,
) -> dict:
    """The summary of a finished run (``summary.json``; :meth:`Trainer.fit` documents the keys):
    ``checkpoint`` the final one (None: checkpoints off), ``best`` the early-stopping /
    keep_best tracker, ``keep_best`` whether the best checkpoint is kept, ``wall`` the
    ``PhaseClock`` split, ``weights_step`` the step whose weights ``validation`` and ``test``
    (and the final checkpoint) are of (default ``steps``). Non-finite numbers become None."""
    summary = {
        "run_dir": str(run_dir),
        "world_size": world_size,
        "steps": steps,
        "weights_step": steps if weights_step is None else weights_step,
        "rows_trained": rows_trained,
        "train_seconds": round(train_seconds, 3),
        "samples_per_s": round(rows_trained / train_seconds, 1) if train_seconds > 0 else None,
        "resumed_at_step": resumed_at_step,
        "validation": summary_metrics(validation),
        "test": summary_metrics(test),
    }
    if checkpoint is not None:
        summary["checkpoint"] = str(checkpoint)
    if best is not None:
        kept = best_checkpoint(run_dir) if keep_best else None
        summary["best"] = {
            "metric": best.metric,
            "value": best.best,
            "step": best.best_step,
            "early_stopped": best.stopped,
            "checkpoint": str(kept) if kept else None,
        }
    summary.update(wall)  # wall_seconds, wall_split: from the run's start to here
    return finite_or_none(summary)


def summary_metrics(metrics: dict) -> dict:
    """The summary's metrics of a split: auc, logloss, ne (None where absent); with several
    tasks also every ``<task>/<metric>``; for a retrieval model also its ``recall@K`` etc."""
    per_task = {k: v for k, v in metrics.items() if "/" in k}
    extra = (
        "retrieval_users",
        "corpus_items",
        "mrr",
        "popular_mrr",
        "next_item_rows",
        "next_item_skipped",
        "catalogue",
    )
    retrieval = {k: v for k, v in metrics.items() if "@" in k or k in extra}
    return {**(per_task or {k: metrics.get(k) for k in ("auc", "logloss", "ne")}), **retrieval}


def print_summary(summary: dict) -> None:
    """Print the summary as ``recsys-dist train`` ends: samples, steps, metrics, run directory."""

    def fmt(x):
        return "n/a" if x is None else f"{x:.4f}"

    if summary.get("already_complete"):
        print("\n" + run_dirs.nothing_to_train(summary["run_dir"], summary["resumed_from"], summary["steps"]))
        return
    v, t = summary["validation"] or {}, summary["test"] or {}
    resumed = summary.get("resumed_at_step")
    print(
        f"\nrecsys-dist: trained {summary['rows_trained']} samples in {summary['steps']} steps on "
        f"{summary['world_size']} rank{'s' if summary['world_size'] != 1 else ''}, {summary['samples_per_s']} samples/s"
        + (f" (resumed at step {resumed})" if resumed is not None else "")
        + "\n"
        + (_stream_lines(summary, v, fmt) if "partitions" in summary else _split_lines(v, t, fmt))
        + _retrieval_lines(v, t, fmt)
        + f"  run directory: {summary['run_dir']}"
    )
    best = summary.get("best")
    if best:
        print(
            f"  best validation {best['metric']} {fmt(best['value'])} at step {best['step']}"
            + (" (stopped early)" if best["early_stopped"] else "")
            + (f": {best['checkpoint']} (`best`)" if best.get("checkpoint") else "")
        )
        weights = summary.get("weights_step")
        if weights is not None:
            print(f"  {_scored_line(weights, summary['steps'], best.get('step'))}")


def _scored_line(weights: int, steps: int, best: int | None) -> str:
    """Which step's weights the validation and test lines (and the final checkpoint) are of."""
    if weights != steps:
        return f"scored: the weights of step {weights}, the best validation's (restored; trained to step {steps})"
    if best == steps:
        return f"scored: the weights of step {steps}, the last and the best validation's"
    return f"scored: the last weights, step {steps}" + (
        f" (the best validation's are step {best}'s)" if best is not None else ""
    )


def _stream_lines(summary: dict, v: dict, fmt) -> str:
    """A stream run's partitions, quarantined ones, why it stopped, its last progressive validation."""
    parts, bad = summary["partitions"], summary.get("quarantined") or {}
    lines = f"  partitions  {len(parts)} trained" + (f" ({parts[0]} .. {parts[-1]})" if parts else "")
    lines += f", {len(bad)} quarantined: {', '.join(bad)}" if bad else ""
    skipped = summary.get("rows_skipped") or 0
    lines += f", {skipped} bad row(s) skipped (data.on_bad_row: skip)" if skipped else ""
    lines += f"; stopped: {summary.get('stopped')}\n"
    if v.get("auc") is not None or v.get("logloss") is not None:
        lines += f"  last partition before training on it: AUC {fmt(v.get('auc'))}  logloss {fmt(v.get('logloss'))}\n"
    return lines


def _retrieval_lines(v: dict, t: dict, fmt) -> str:
    """recall@K / NDCG@K of a retrieval model (and the most-popular baseline's), per split."""
    ks = sorted({int(k.split("@")[1]) for k in [*v, *t] if k.startswith("recall@")})
    lines = ""
    for split, m in (("validation", v), ("test", t)):
        for k in ks:
            lines += (
                f"  {split:<11} recall@{k} {fmt(m.get(f'recall@{k}'))}  NDCG@{k} {fmt(m.get(f'ndcg@{k}'))}  "
                f"(most popular: recall@{k} {fmt(m.get(f'popular_recall@{k}'))}  NDCG@{k} {fmt(m.get(f'popular_ndcg@{k}'))})\n"
            )
    # Next-item retrieval (hstu_retrieval): HR@K / NDCG@K and MRR of each held-out row's next item.
    hr_ks = sorted({int(k.split("@")[1]) for k in [*v, *t] if k.startswith("hr@")})
    for split, m in (("validation", v), ("test", t)) if hr_ks else ():
        lines += f"  {split:<11} " + "  ".join(
            f"HR@{k} {fmt(m.get(f'hr@{k}'))}  NDCG@{k} {fmt(m.get(f'ndcg@{k}'))}" for k in hr_ks
        )
        lines += f"  MRR {fmt(m.get('mrr'))}  (most popular: MRR {fmt(m.get('popular_mrr'))})\n"
    return lines


def _split_lines(v: dict, t: dict, fmt) -> str:
    """The validation and test lines: AUC / logloss, or per task (several tasks) its metrics."""
    task_keys = [k for k in v if "/" in k] or [k for k in t if "/" in k]
    if not task_keys:
        return (
            f"  validation  AUC {fmt(v['auc'])}  logloss {fmt(v['logloss'])}\n"
            f"  test        AUC {fmt(t['auc'])}  logloss {fmt(t['logloss'])}\n"
        )
    names = list(dict.fromkeys(k.split("/")[0] for k in task_keys))
    shown = {"auc": "AUC", "logloss": "logloss", "rmse": "RMSE", "mae": "MAE"}
    lines = ""
    for split, m in (("validation", v), ("test", t)):
        for name in names:
            parts = [f"{label} {fmt(m.get(f'{name}/{k}'))}" for k, label in shown.items() if f"{name}/{k}" in m]
            lines += f"  {split:<11} {name}: {'  '.join(parts)}\n"
    return lines
