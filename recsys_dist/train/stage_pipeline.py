"""The training step under ``distributed.dense.strategy: pipeline`` (docs/design/pipeline.md).

Per step, on every rank (every rank runs the same collectives whatever its stage, also when its
batch is padding only); a pipeline is S ranks (``dense_stages.group``), dp = W / S of them:

1. ``pooled = model.pipeline_input(dense, kjt)``: ``[B, d]``, a live graph into the sharded
   tables (their forward is collective over all ranks).
2. The (label, weight) rows of the pipeline's ranks to each of them (all_gather: the last
   stage's target; summed over the pipelines, the global weight); ``pooled`` (detached) of each
   to stage 0 (gather): ``x = [pooled_0; ...; pooled_{S-1}]``, ``[S*B, d]``, a leaf that requires grad.
3. ``schedule.step``: the microbatches through the stages (the loss on the last one: see
   ``recsys_dist.distributed.stages._loss_fn``); each stage's parameter gradients are the mean
   over the microbatches (``scale_grads``), and ``x.grad`` their sum, so stage 0 divides it by
   the microbatches: dp x d(global weighted mean loss)/dx.
4. Each rank's rows of that gradient back to it (scatter), and ``pooled.backward(g * W / dp)``:
   TorchRec divides the pooled embeddings' gradient by the world size in its backward (it
   expects DDP's per-rank losses), so W undoes it, and 1 / dp the dp above. (W is the job's
   ranks; under ``sharding.replica_groups`` N TorchRec divides by a sharding group's W / N, as
   it does under ddp there, and the replicas' sync averages the N groups' updates.) The fused table
   optimizers step in that backward. Gradients of replicated parameters outside the tower
   (data-parallel tables) are averaged over the ranks, and (dp > 1) each stage's over the
   pipelines, as DDP would.
5. The optimizer steps (each rank: its stages' parameters, the only tower parameters it holds).
6. This rank's logits from its last stage (broadcast), for the metrics, and its loss from them
   (as ddp's: ``StagePipeline._own_loss``), for the log and ``on_step_end``.

TrainPipelineSparseDist's overlap of the next batch's input_dist does not apply here (the batch
goes through ``pipeline_input`` directly): this is ``train.pipeline: base``'s order.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division

from recsys_dist.distributed.stages import DenseStages, probing


class StagePipeline:
    """A :class:`recsys_dist.train.pipelines.TrainPipeline` for a DMP with ``dense_stages``.

    ``progress`` returns ``(loss, logits, labels, weights)`` as TorchRec's pipelines do (the
    task's second output), where ``loss`` is this rank's loss as ``ddp``'s step gives it (its rows'
    weighted mean loss x the batch's loss scale, float32 scalar; its mean over the ranks, the
    train log's loss, is the global batch's weighted mean) and ``logits`` this rank's rows, ``[B]`` float32.
    Scoring passes use the model's forward (``recsys_dist.distributed.stages.scoring_forward``),
    so ``detach`` has nothing to do.
    """

    steps_done = 0

    def __init__(self, model, optimizer, device: torch.device) -> None:
        self._model, self._optimizer, self._device = model, optimizer, device
        self._stages: DenseStages = model.dense_stages
        self._task = model.module
        self._checked = False

    def progress(self, dataloader_iter):
        batch = next(dataloader_iter).to(self._device, non_blocking=True)
        st, group = self._stages, self._stages.group
        size, rank = dist.get_world_size(group), st.index
        last = size - 1  # the rank of the last stage (loop placement: also with several stages per rank)
        self._optimizer.zero_grad()
        with probing(st) if not self._checked else contextlib.nullcontext({}) as probes:
            pooled = self._task.model.pipeline_input(batch.dense_features, batch.sparse_features)
        rows = torch.stack([batch.labels.float(), batch.weights.float()], dim=1)
        every = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(every, rows, group=group)
        target = torch.cat(every)
        total = _global_weight(target, st.dp_group)
        st.loss_scale = st.microbatches * st.dp / total if total > 0 else 0.0
        parts = [torch.empty_like(pooled) for _ in range(size)] if rank == 0 else None
        dist.gather(pooled.detach().contiguous(), parts, dst=dist.get_global_rank(group, 0), group=group)
        args = ()
        if rank == 0:
            x = torch.cat(parts).requires_grad_()
            args = (x,)
        kwargs = {"target": target} if rank == last else {}
        out = st.schedule.step(*args, **kwargs)
        grad = torch.empty_like(pooled)
        chunks = list((x.grad / st.microbatches).split(pooled.shape[0])) if rank == 0 else None
        dist.scatter(grad, chunks, src=dist.get_global_rank(group, 0), group=group)
        world = st.world_size  # the job's ranks, also under sharding.replica_groups
        # x.grad / microbatches is dp x d(global loss)/dx; x W as ddp's per-rank loss gives it.
        # TorchRec divides by its all-to-all's ranks: W in one group; under replica groups a
        # sharding group's W / N, so each replica gets N x its group's share, which the sync's
        # average over the N replicas undoes (as under ddp: docs/design/replica_groups.md).
        pooled.backward(grad * ((world if get_gradient_division() else 1) / st.dp))
        if not self._checked:  # its first step (steps_done is the run's step count on a resume)
            _check_input_grads(probes)
            self._checked = True
        _average(st.rest, None, world)  # replicated parameters outside the tower: DDP's mean
        if st.dp_group is not None:  # the same stage in every pipeline: DDP's mean over them
            _average([p for m in st.own_modules() for p in m.parameters()], st.dp_group, st.dp)
        self._optimizer.step()
        result = torch.empty(target.shape[0], device=pooled.device)
        if rank == last:
            result.copy_(out.detach().squeeze(-1).float())
        dist.broadcast(result, src=dist.get_global_rank(group, last), group=group)
        b = pooled.shape[0]
        logits = result[rank * b : (rank + 1) * b]
        self.steps_done += 1
        return self._own_loss(logits, batch, world, total), logits, batch.labels, batch.weights

    def _own_loss(self, logits: torch.Tensor, batch, world: int, total: float) -> torch.Tensor:
        """This rank's loss as ddp's step gives it (``CTRTask``: its rows' weighted mean loss x
        its weight x W / the global weight), from its rows' logits: what ``on_step_end`` gets
        and the train log averages. (The pipeline's loss, the schedule's, is the mean of its S
        ranks' such losses: before, ``on_step_end`` got that, not this rank's number.)"""
        weights = batch.weights.float()
        scale = float(weights.sum()) * world / total if total > 0 else 0.0
        with torch.no_grad():
            return self._task.loss(logits, batch.labels.float(), weights) * scale

    def detach(self) -> torch.nn.Module:
        return self._model

    def pop_times(self) -> dict[str, float]:
        return {}

    def reset(self) -> None:
        pass


def _check_input_grads(probes: dict[str, torch.Tensor]) -> None:
    """Refuse, on every rank (one collective), a ``pipeline_input`` that uses a parameter of the
    tower: its gradient through the input would be lost on the ranks that do not hold it and
    added unaveraged on the one that does (wrong numbers). ``probes``: this rank's freed
    parameters' stand-ins of the first step (``recsys_dist.distributed.stages.probing``); one
    used got a gradient in the backward. Every tower parameter is freed on some rank of its
    pipeline (stages >= 2), so some rank sees each use.

    Raises:
        ValueError: naming the parameters, on every rank.
    """
    mine = sorted(name for name, leaf in probes.items() if leaf.grad is not None)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    used = sorted({n for names_of_rank in every for n in names_of_rank})
    if used:
        raise ValueError(
            "distributed.dense.strategy: pipeline: the model's pipeline_input uses parameters of its tower "
            f"({', '.join(used)}); pipeline_input must hold no dense parameter of pipeline_tower's modules "
            "(docs/design/pipeline.md): move that use into the tower, or use strategy ddp"
        )


def _global_weight(target: torch.Tensor, dp_group) -> float:
    """The weight of the global batch: this pipeline's rows' (``target[:, 1]``), summed over the
    pipelines."""
    total = target[:, 1].sum()
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    return float(total)


def _average(params, group, size: int) -> None:
    """Each gradient of ``params`` averaged over ``group`` (None: the world) of ``size`` ranks (a
    missing gradient counts as zeros), in place: one all-reduce of the gradients laid end to end
    (as DDP's buckets), not one per parameter."""
    params = [p for p in dict.fromkeys(params) if p.requires_grad]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= size
    for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad.copy_(g.view_as(p.grad))
