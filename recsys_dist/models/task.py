"""The task wrapper: logits from a model, the weighted training loss (one task, or a weighted
sum over several), outputs for metrics."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from recsys_dist.models.losses import bce


class CTRTask(nn.Module):
    """Wraps a model ``f(dense [B, D], kjt) -> logits [B, 1]`` with the training loss.

    ``forward(batch)`` returns ``(loss, (loss, logits, labels, weights))``: the shape
    TorchRec's train pipelines expect (with several tasks the second, detached ``loss`` is
    float32 ``[1 + T]``: the loss, then each task's own loss before ``loss_weights``, all
    scaled alike; the trainer logs them as ``loss/<task>``).

    A model may also return a dict ``{"logits": ..., name: tensor, ...}``: ``logits`` is what
    the metrics and ``predict`` read, and every other entry is passed to the loss function as
    a keyword argument (``loss_fn(logits, labels, weights, **extras, **loss_args)``), for a
    loss that needs more than one score per row, e.g. the ``[B, B]`` candidate scores of an
    in-batch sampled softmax (``recsys_dist.models.losses.in_batch_softmax``, the
    ``two_tower`` model). A loss that does not take an entry raises TypeError at the first
    batch. The loss is ``loss_fn(logits, labels, weights,
    **loss_args)`` (``recsys_dist.models.losses``; default binary cross-entropy, the weighted
    mean over rows); rows with weight 0 (padding) contribute nothing, and a batch of padding
    only gives loss 0 with zero gradients. Logits ``[B, 1]`` are squeezed to ``[B]``.

    ``remap``: a :class:`recsys_dist.models.managed.ManagedRemap` that maps the batch's raw ids
    to table rows first (``data.categorical_mapping: managed``), or None.

    The loss is then multiplied by ``batch.loss_scale`` (when set): this rank's weight x world
    size / the global batch's weight (weight = the sum of the batch's ``weights``: its real
    rows, or their sample weights with ``data.schema.weight``). DDP averages the dense
    gradients over ranks and TorchRec's output_dist averages the pooled-embedding gradients
    the same way, so the step follows the weighted mean over the rows of the whole global
    batch, ``sum_i w_i l_i / sum_i w_i`` over every rank's rows, at any world size, also for a
    last batch that is padding on some ranks (a full batch of weight-1 rows has scale 1).

    ``bf16_device``: a device type ("cpu", "cuda"); the model's forward then runs under
    ``torch.autocast`` with bfloat16 (mixed precision: matmuls in bfloat16, parameters and
    gradients float32). The type is fixed here, not read from the batch, because
    TrainPipelineSparseDist traces this forward with torch.fx. Logits and the loss are
    float32 either way.

    ``tasks`` (several tasks, ``data.schema.labels``): ``[(name, loss_fn, loss_args,
    weight), ...]`` in label-column order; the model then returns logits ``[B, T]``, labels
    are ``[B, T]``, and the loss is ``sum_t weight_t * loss_fn_t(logits[:, t], labels[:, t],
    weights, **loss_args_t)``, each term the weighted mean over real rows. A model output
    of another width raises ValueError at the first batch.

    Attributes:
        model: the wrapped model (what the model factory built), e.g. to call methods of
            your own on the model that ``recsys_dist.load_model`` returns.
        loss: the loss, as a module.
    """

    def __init__(
        self,
        model: nn.Module,
        bf16_device: str | None = None,
        loss_fn=None,
        loss_args: dict | None = None,
        remap: nn.Module | None = None,
        tasks: list[tuple] | None = None,
    ) -> None:
        super().__init__()
        self.model, self.bf16_device = model, bf16_device
        # Managed-collision tables (recsys_dist.models.managed): raw ids -> rows before the model.
        self.remap = remap
        self.task_names = [t[0] for t in tasks] if tasks else ["label"]
        # A child module without sharded tables: TrainPipelineSparseDist's fx trace treats it
        # as a leaf, so the loss function may use Python control flow on tensors.
        self.multi_task = bool(tasks and len(tasks) > 1)
        if self.multi_task:
            self.loss = MultiTaskLoss(tasks, with_terms=True)
        elif tasks:  # one task named in data.schema.labels: its loss (a weight does not matter alone)
            self.loss = Loss(tasks[0][1], tasks[0][2])
        else:
            self.loss = Loss(loss_fn or bce, loss_args)

    def managed_metrics(self, split: str = "train") -> dict:
        """The managed-collision tables' metrics of ``split`` since the last call
        (``recsys_dist.models.managed.ManagedRemap.metrics``: ``{"managed": {...}}``), ``{}``
        without them. A collective when the job has several ranks: every rank calls it."""
        return {} if self.remap is None else self.remap.metrics(split)

    def managed_counters(self) -> dict[str, dict[str, int]]:
        """Their cumulative counters per feature (``ManagedRemap.counters``; not a collective),
        ``{}`` without them."""
        return {} if self.remap is None else self.remap.counters()

    def forward(self, batch):
        mixed = self.bf16_device is not None
        with torch.autocast(self.bf16_device, dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
            sparse = batch.sparse_features if self.remap is None else self.remap(batch.sparse_features, batch.weights)
            out = self.model(batch.dense_features, sparse)
        # A dict (logits and the loss's other inputs) is a Python dict of proxies under the
        # pipeline's fx trace too, so this branch is decided at trace time.
        extras = {k: v for k, v in out.items() if k != "logits"} if isinstance(out, dict) else {}
        logits = _one_task(out["logits"] if isinstance(out, dict) else out).float()
        loss = _scaled(self.loss(logits, batch.labels, batch.weights, **extras), batch.loss_scale)
        logged = loss.detach()
        if self.multi_task:  # [1 + T]: the total, then the tasks' own losses (for the log)
            loss = loss[0]
        return loss, (logged, logits.detach(), batch.labels, batch.weights)


class Loss(nn.Module):
    """``fn(logits, labels, weights, **extras, **args) -> scalar`` as a module (no parameters,
    no state); ``extras``: the model's outputs besides ``logits`` (see :class:`CTRTask`)."""

    def __init__(self, fn, args: dict | None = None) -> None:
        super().__init__()
        self.fn, self.args = fn, dict(args or {})

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, **extras) -> torch.Tensor:
        return self.fn(logits, labels, weights, **extras, **self.args)


class MultiTaskLoss(nn.Module):
    """``sum_t w_t * fn_t(logits[:, t], labels[:, t], weights, **args_t)`` over the tasks
    ``[(name, fn, args, w), ...]``; logits and labels ``[B, T]``, weights ``[B]``.

    ``with_terms``: return float32 ``[1 + T]`` instead of the scalar: the total, then each
    ``fn_t(...)`` (before its weight ``w_t``).

    Raises:
        ValueError: logits that are not ``[B, T]`` (a model with one output per row).
    """

    def __init__(self, tasks: list[tuple], with_terms: bool = False) -> None:
        super().__init__()
        self.names, self.with_terms = [t[0] for t in tasks], with_terms
        self.losses = nn.ModuleList(Loss(fn, args) for _, fn, args, _ in tasks)
        self.task_weights = [float(t[3]) for t in tasks]

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, **extras) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[1] != len(self.names):
            raise ValueError(
                f"the model returned logits of shape {tuple(logits.shape)}; with the tasks {self.names} it must "
                f"return [B, {len(self.names)}] (one logit per task, in data.schema.labels order)"
            )
        total, terms = logits.new_zeros(()), []
        for t, (fn, w) in enumerate(zip(self.losses, self.task_weights)):
            terms.append(fn(logits[:, t], labels[:, t], weights, **extras))
            total = total + w * terms[-1]
        return torch.stack([total, *terms]) if self.with_terms else total


@torch.fx.wrap
def _scaled(loss: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    # A leaf for torch.fx: batches made outside the loader carry no scale (None).
    return loss if scale is None else loss * scale


@torch.fx.wrap
def _one_task(logits: torch.Tensor) -> torch.Tensor:
    # [B, 1] -> [B]; [B] and [B, T] (several tasks) stay. A leaf for torch.fx: the pipeline's
    # trace cannot read a shape.
    return logits.squeeze(-1) if logits.dim() == 2 and logits.shape[1] == 1 else logits
