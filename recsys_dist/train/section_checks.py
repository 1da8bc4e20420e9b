"""Checks across config sections that the config alone decides: tasks against losses, the
evaluation against the features, a stream's unused keys, publishing against checkpoints.

Torch-free and model-free (the format object gives the task and feature names), so that
``recsys-dist preprocess`` refuses what ``train`` would refuse about them without importing
torch, TorchRec or the model; the checks that need the model or the machine are
``recsys_dist.train.preflight``'s, which runs these too.
"""

from __future__ import annotations

from dataclasses import dataclass

from recsys_dist.checkpoint.config import CheckpointConfig
from recsys_dist.data.config import DataConfig
from recsys_dist.data.formats.base import RawFormat
from recsys_dist.train.config import EvalConfig, PublishConfig, TrainConfig


@dataclass(frozen=True)
class Sections:
    """The sections these checks read (of a ``RunConfig`` before it is resolved: ``preprocess``;
    or of a resolved ``Job``: preflight), with the data's format object."""

    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    publish: PublishConfig
    fmt: RawFormat


def config_problems(run: Sections) -> list[str]:
    """Problems that involve two sections and neither the model nor the machine (each as
    "dotted.key: what is wrong; the fix")."""
    fmt = run.fmt
    problems = _task_problems(run, list(fmt.task_names), list(fmt.task_kinds))
    problems += _eval_problems(run, list(fmt.task_names), list(fmt.sparse_names))
    if run.data.stream is not None:
        problems += _stream_problems(run)
    problems += _publish_problems(run)
    if run.checkpoint.keep_best and not run.checkpoint.enabled:
        problems.append(
            "checkpoint.keep_best: keeps a checkpoint, but checkpoint.enabled is false; enable checkpoints or "
            "remove keep_best"
        )
    return problems


def _task_problems(run: Sections, names: list[str], kinds: list[str]) -> list[str]:
    """Losses and loss weights against the data's tasks (``data.schema.labels``)."""
    problems = []
    t = run.train
    named = list(t.loss) if isinstance(t.loss, dict) else []
    for key, keys in (("train.loss", named), ("train.loss_weights", list(t.loss_weights))):
        problems += [
            f"{key}.{k}: no task {k!r}; the tasks (data.schema.labels) are {names}" for k in keys if k not in names
        ]
    for task, kind, (loss, _, _) in zip(names, kinds, t.task_losses(names, kinds)):
        if kind == "regression" and loss in ("bce", "focal"):
            problems.append(
                f"train.loss{'.' + task if named else ''}: {loss} needs 0/1 labels and task {task!r} is a regression; "
                "use mse (the default for regression tasks)"
            )
    return problems


def _eval_problems(run: Sections, names: list[str], sparse: list[str]) -> list[str]:
    """Streaming metrics and GAUC against the tasks, the sample weights and the features."""
    problems = []
    if len(names) > 1 and run.eval.auc_buckets:
        problems.append(
            "eval.auc_buckets: streaming metrics are for one task; several tasks are scored exactly (remove it)"
        )
    if len(names) > 1 and run.eval.group_feature is not None:
        problems.append("eval.group_feature: GAUC is for one binary task; remove it with data.schema.labels")
    if run.data.schema is not None and run.data.schema.weight and run.eval.auc_buckets:
        problems.append("eval.auc_buckets: streaming metrics are unweighted; with data.schema.weight remove it")
    g = run.eval.group_feature
    if g is not None:
        multi_hot = set(run.data.schema.multi_hot) if run.data.schema else set()
        if g not in sparse:
            problems.append(f"eval.group_feature: {g!r} is not a categorical feature; valid: {', '.join(sparse)}")
        elif g in multi_hot:
            problems.append(f"eval.group_feature: {g!r} is multi-hot; GAUC groups by one id per row")
        if run.eval.auc_buckets:
            problems.append(
                "eval.group_feature: GAUC needs every prediction; it cannot be combined with eval.auc_buckets"
            )
    return problems


def _stream_problems(run: Sections) -> list[str]:
    """What a run over ``data.stream`` does not use (it has no epochs and no fixed splits)."""
    t, e = run.train, run.eval
    unused = [
        ("train.epochs", t.epochs != 1, "a stream is one pass over its partitions"),
        ("train.early_stopping", t.early_stopping is not None, "a stream keeps training as data lands"),
        ("eval.every_n_steps", e.every_n_steps is not None, "each partition is scored before it is trained on"),
        ("checkpoint.keep_best", run.checkpoint.keep_best, "a stream has no one validation split to rank by"),
    ]
    return [f"{key}: not used with data.stream ({why}); remove it" for key, given, why in unused if given]


def _publish_problems(run: Sections) -> list[str]:
    """Publishing reads the run's checkpoints: they must be written where it publishes."""
    p, c = run.publish, run.checkpoint
    if not p.enabled:
        return []
    if not c.enabled:
        return ["publish.enabled: publishes the run's checkpoints, but checkpoint.enabled is false; enable them"]
    if p.every_partition and run.data.stream is None:
        return ["publish.every_partition: a run over data.raw_path has no partitions; use publish.every_n_steps"]
    if p.every_n_steps is not None and (c.every_n_steps is None or p.every_n_steps % c.every_n_steps):
        return [
            f"publish.every_n_steps: {p.every_n_steps} is not a multiple of checkpoint.every_n_steps "
            f"({c.every_n_steps}): a version is published from the checkpoint of its step; set "
            f"checkpoint.every_n_steps to {p.every_n_steps} or a divisor of it"
        ]
    return []
