"""Scoring a sharded model on one split: global metrics, and per-row predictions in row order.

Both functions are collective: every rank calls them with its own loader of the same split
(the loaders yield the same number of batches on every rank), and every rank gets the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from recsys_dist.data.loader import ParquetBatchLoader, partition_row_groups
from recsys_dist.train.metrics import (
    StreamingBinaryMetrics,
    binary_metrics,
    gather_predictions,
    gather_rows,
    task_metrics,
)


@torch.no_grad()
def evaluate(
    dmp: nn.Module,
    loader: ParquetBatchLoader,
    device: torch.device,
    auc_buckets: int | None = None,
    group_feature: str | None = None,
    tasks: tuple[list[str], list[str]] | None = None,
) -> dict:
    """Metrics over every rank's predictions on one split (padding excluded).

    ``auc_buckets`` None: exact, gathers every prediction; N: streaming histogram metrics in
    memory independent of the split's size (``auc_error_bound`` is reported).
    ``group_feature``: a one-hot categorical key whose ids group rows for GAUC. Every rank
    must call this, since both paths end in a collective.
    ``tasks``: (names, kinds) of several tasks (``features.tasks``, ``features.task_kinds`` of the job's FeatureSpec); the metrics are
    then those of :func:`recsys_dist.train.metrics.task_metrics` per task, keys ``<task>/<metric>``
    (``like/auc``, ``rating/rmse``), plus ``num_examples``. A loader with sample weights
    (``weight_column``) gives weighted metrics (one task: unprefixed keys). Exact path only.

    Returns:
        ``recsys_dist.train.metrics.binary_metrics``'s dict (``auc``, ``logloss``, ``ne``,
        ``calibration``, ``accuracy``, ``num_examples``, ...); ``{}`` when the split is empty.
    """
    was_training = dmp.training
    dmp.eval()
    stream = StreamingBinaryMetrics(auc_buckets, device=device) if auc_buckets else None
    logits, labels, weights, groups = [], [], [], []
    if tasks is not None or loader.weight_column:
        names, kinds = tasks or (["label"], ["binary"])
    else:
        names = kinds = None
    for batch in loader:
        if group_feature:
            groups.append(batch.sparse_features[group_feature].values())
        _, (_, lg, lb, w) = dmp(batch.to(device))
        if stream is not None:
            stream.update(lg, lb, w)
        else:
            logits.append(lg), labels.append(lb), weights.append(w)
    dmp.train(was_training)
    if stream is not None:
        return stream.merge().compute()
    if not logits:
        return {}
    if kinds is not None:  # several tasks, or sample weights: weighted metrics per task
        lg, lb, w = torch.cat(logits), torch.cat(labels), torch.cat(weights)
        lg, lb = lg.reshape(len(w), -1), lb.reshape(len(w), -1)
        # Padding has weight 0; so has a row of sample weight 0, which would weigh nothing anyway.
        rows = gather_rows(torch.cat([lg.float(), lb.float(), w.float().unsqueeze(1)], dim=1), w > 0)
        T = lg.shape[1]
        if names == ["label"]:  # the one-task form with sample weights: the keys of one task
            return task_metrics(rows[:, 0], rows[:, 1], rows[:, 2], kinds[0])
        out: dict = {"num_examples": len(rows)}
        for t, (name, kind) in enumerate(zip(names, kinds)):
            for key, value in task_metrics(rows[:, t], rows[:, T + t], rows[:, 2 * T], kind).items():
                if key != "num_examples":
                    out[f"{name}/{key}"] = value
        return out
    if group_feature:
        lg, lb, g = gather_predictions(
            torch.cat(logits), torch.cat(labels), torch.cat(weights), groups=torch.cat(groups).to(device)
        )
        return binary_metrics(lg, lb, groups=g)
    all_logits, all_labels = gather_predictions(torch.cat(logits), torch.cat(labels), torch.cat(weights))
    return binary_metrics(all_logits, all_labels)


def in_row_order(loader: ParquetBatchLoader) -> ParquetBatchLoader:
    """A loader of the same files, rank and batch size that yields every row once, in file
    order: unshuffled, the remainder padded, without loss_scale (evaluation applies none).
    ``loader`` itself when it already yields every row in order."""
    if not loader.shuffle and loader.remainder == "pad":
        return loader
    return loader.reopen(shuffle=False, remainder="pad", scale_losses=False)


@torch.no_grad()
def predict(dmp: nn.Module, loader: ParquetBatchLoader, device: torch.device) -> dict[str, torch.Tensor]:
    """Every row's logit, probability and label, in the row order of the loader's files,
    identical on every rank (one all_gather; O(rows) memory on every rank).

    Every rank must call this with its loader of the same files (same batch size, its own
    rank). Padding rows are dropped.

    Returns:
        ``{"logit", "probability", "label"}``: float32 CPU tensors of shape [N] ([N, T] with
        several tasks, a column per task; every row, whatever its sample weight), N = the rows
        of the files (fewer with ``remainder="drop"``: the last partial global batch's rows
        are missing); ``probability = sigmoid(logit)``.

    Raises:
        ValueError: the loader shuffles (its order changes every epoch; see
            :func:`in_row_order`), or reads row groups per rank and drops the remainder.
    """
    if loader.shuffle:
        raise ValueError("predict needs an unshuffled loader (row order); pass in_row_order(loader)")
    if loader.rank_reads == "row_groups" and loader.remainder == "drop":
        raise ValueError("predict with rank_reads='row_groups' needs remainder='pad'; pass in_row_order(loader)")
    if loader.weight_column:  # every row, whatever its sample weight: only padding has weight 0
        loader = _unweighted(loader)
    was_training = dmp.training
    dmp.eval()
    batches = []
    T = len(loader.label_columns)
    for batch in loader:
        _, (_, lg, lb, w) = dmp(batch.to(device))
        # [2T + 1, B]: the logits, the labels (a row per task), the weights
        batches.append(torch.cat([lg.float().reshape(-1, T).T, lb.float().reshape(-1, T).T, w.float().reshape(1, -1)]))
    dmp.train(was_training)
    B, C = loader.batch_size, 2 * T + 1
    local = torch.stack(batches, dim=1) if batches else torch.zeros(C, 0, B, device=device)  # [C, steps, B]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    parts = [local]
    if world > 1 and local.numel():  # every rank yields the same number of batches: the shapes agree
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
    parts = [p.cpu() for p in parts]
    if loader.rank_reads == "row_groups":
        # Rank r's real rows are its own row groups, in file order: put the groups back in order.
        sizes = [n for *_, n in loader.row_groups]
        chunks = {}
        for r, owned in enumerate(partition_row_groups(sizes, world)):
            flat = parts[r].reshape(C, -1)
            real = flat[:, flat[-1] > 0]
            for group, piece in zip(owned, real.split([sizes[g] for g in owned], dim=1)):
                chunks[group] = piece
        rows = torch.cat([chunks[g] for g in sorted(chunks)], dim=1) if chunks else torch.zeros(C, 0)
    else:
        # Global batch g is rows [g*B*W, (g+1)*B*W) of the stream; rank r holds the r-th block of B.
        flat = torch.stack(parts, dim=2).reshape(C, -1)  # [C, steps, W, B] -> stream order
        rows = flat[:, flat[-1] > 0]
    if T == 1:
        logit, label = rows[0].contiguous(), rows[1].contiguous()
    else:  # [N, T]
        logit, label = rows[:T].T.contiguous(), rows[T : 2 * T].T.contiguous()
    return {"logit": logit, "probability": torch.sigmoid(logit), "label": label}


def _unweighted(loader: ParquetBatchLoader) -> ParquetBatchLoader:
    return loader.reopen(weight_column=None)
