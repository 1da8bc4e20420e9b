"""What ``distributed.dense.strategy: pipeline`` lays out and moves per step, for the plan and the ledger.

The layout (:func:`pipeline_layout`): the ``dp x S`` grid of ranks, each stage's modules,
parameters, output width and ranks, from a model built on any device (``recsys-dist plan``
builds it on meta). The bytes (:func:`add_pipeline_flows`), per step, as
:class:`recsys_dist.train.stage_pipeline.StagePipeline` and torch.distributed.pipelining move
them (fp32 throughout: the stages run in fp32), in two phases of the ledger and its all-reduce:

- ``pipeline_io``, around the schedule, within each pipeline of S ranks: the all_gather of each
  rank's (label, weight) rows (``B x 2`` each); the all-reduce of the batch weight over the
  data-parallel group (one float, dp > 1); the gather of the pooled embeddings (``B x d``) to
  pipeline rank 0 and the scatter of their gradient back; the broadcast of the pipeline's logits
  (``S x B`` floats; each rank computes its own loss from its rows) from pipeline rank S - 1.
- ``pipeline_p2p``: torch's send / recv between consecutive stages k -> k + 1 (always on two
  ranks: loop placement), each microbatch's activations ``[S x B / m, w_k]`` forward and their
  gradient backward: ``S x B x w_k`` floats each way per step, whatever the microbatch count.
- ``allreduce`` (table ``dense``): with dp > 1, the data-parallel all-reduce of each rank's
  stages' gradients (its stages' parameter bytes); over the world, that of the replicated
  parameters outside the tower and the tables (none in the zoo's models). The data_parallel
  tables' all-reduce is the ledger's own (per table).

Counting rules: the ledger's (an all-gather of a chunk: ``S - 1`` chunks each way; an
all-reduce: its payload); a gather / scatter / broadcast: its root sends (or receives) one
chunk per other rank, each other rank one chunk. Once per run and not counted: the stages'
first-step shape exchange and the check of the first step's gradients. Scoring passes
(``recsys_dist.distributed.stages.run_stages``) are not training steps and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.distributed.config import DenseConfig
from recsys_dist.distributed.ledger import Ledger, dense_parameter_bytes
from recsys_dist.distributed.stages import cut_model, mesh_order, split_auto

FLOAT = 4  # fp32 bytes


@dataclass
class PipelineLayout:
    """One pipeline's stages and the grid of pipelines.

    Attributes:
        ranks: ``S``, the ranks of one pipeline; ``dp``: the pipelines side by side.
        per_rank: stages per rank (``v``); ``schedule`` and ``microbatches`` as configured.
        input_width: ``d``, the columns of ``pipeline_input``'s output.
        starts: each stage's first module (``S x v``); ``modules``: the tower's module count.
        widths: each stage's output columns (the last stage's: the logits, 1).
        parameters: each stage's parameter count; ``rest_bytes``: fp32 bytes of the replicated
            dense parameters outside the tower (not tables).
    """

    ranks: int
    dp: int
    per_rank: int
    schedule: str
    microbatches: int
    input_width: int
    starts: list[int]
    modules: int
    widths: list[int]
    parameters: list[int]
    rest_bytes: int
    replica_groups: int = 1

    def owner(self, stage: int) -> int:
        """The pipeline rank holding ``stage`` (loop placement)."""
        return stage % self.ranks

    def order(self) -> list[int]:
        """The job's ranks in the order the pipelines are laid over them (``stages.mesh_order``)."""
        return mesh_order(self.ranks * self.dp, self.replica_groups)

    def pipeline_rank(self, rank: int) -> int:
        """The pipeline rank of the job's rank ``rank``."""
        return self.order().index(rank) % self.ranks

    def stage_ranks(self, stage: int) -> list[int]:
        """The job's ranks holding ``stage``: its owner in every pipeline."""
        order = self.order()
        return [order[p * self.ranks + self.owner(stage)] for p in range(self.dp)]

    def to_dict(self) -> dict:
        stages = []
        for k, start in enumerate(self.starts):
            end = self.starts[k + 1] if k + 1 < len(self.starts) else self.modules
            stages.append(
                {
                    "stage": k,
                    "modules": [start, end],
                    "parameters": self.parameters[k],
                    "output_width": self.widths[k],
                    "ranks": self.stage_ranks(k),
                }
            )
        order = self.order()
        return {
            "grid": {"dp": self.dp, "pp": self.ranks},
            "pipelines": [order[d * self.ranks : (d + 1) * self.ranks] for d in range(self.dp)],  # by pipeline rank
            "stages_per_rank": self.per_rank,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "input_width": self.input_width,
            "stages": stages,
        }


def pipeline_layout(
    model: nn.Module, dense: DenseConfig, world_size: int, num_dense: int, keys: list[str], replica_groups: int = 1
):
    """The layout of ``model`` (a ``CTRTask`` or a user's model, built on meta or any device, its
    tables not sharded) under ``dense`` at ``world_size`` ranks (the job's; ``replica_groups``:
    ``sharding.replica_groups``), or (None, why). Widths are read
    by running ``pipeline_input`` on a meta batch (``num_dense`` dense columns, one id of each
    of ``keys``) and each tower module on one row of zeros on its own device (no gradient, the
    random state kept: a dropout draws nothing that training would see)."""
    tower, why = cut_model(model)
    if tower is None:
        return None, why
    user = getattr(model, "model", model)
    S, v = dense.stages, dense.pipeline_stages_per_rank
    sizes = [sum(p.numel() for p in m.parameters()) for m in tower]
    starts = [0, *(split_auto(sizes, S * v) if dense.split in (None, "auto") else dense.split)]
    try:
        widths = _widths(user, tower, starts, num_dense, keys)
    except Exception as err:  # noqa: BLE001 - a user's pipeline_input that meta tensors cannot run
        return None, f"its widths could not be read on a meta batch ({type(err).__name__}: {err})"
    ends = [*starts[1:], len(tower)]
    parameters = [sum(sizes[a:b]) for a, b in zip(starts, ends, strict=True)]
    in_tower = {id(p) for m in tower for p in m.parameters()}
    rest = _rest_bytes(user, in_tower)
    layout = PipelineLayout(
        S, world_size // S, v, dense.pipeline_schedule, dense.pipeline_microbatches, widths[0], starts, len(tower),
        widths[1:], parameters, rest, replica_groups,
    )  # fmt: skip
    return layout, ""


def _widths(user: nn.Module, tower: list[nn.Module], starts: list[int], num_dense: int, keys: list[str]) -> list[int]:
    """``[d, w_0, ..., w_{N-1}]``: the input's columns, then each stage's output's."""
    n, rows = len(keys), 2
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.zeros(n * rows, dtype=torch.long, device="meta"),
        lengths=torch.ones(n * rows, dtype=torch.int32, device="meta"),
        stride=rows,
        length_per_key=[rows] * n,  # given, so that nothing reads a meta tensor's values
        offset_per_key=[i * rows for i in range(n + 1)],
    )
    with torch.no_grad():
        width = user.pipeline_input(torch.zeros(rows, num_dense, device="meta"), kjt).shape[1]
    out, ends = [width], {s - 1 for s in starts[1:]} | {len(tower) - 1}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for i, m in enumerate(tower):
            device = next(iter([*m.parameters(), *m.buffers()]), torch.zeros(0, device="meta")).device
            width = m(torch.zeros(1, width, device=device)).shape[1]
            if i in ends:
                out.append(width)
    return out


def _rest_bytes(user: nn.Module, in_tower: set[int]) -> int:
    """fp32 bytes of the parameters with a gradient outside the tower and the embedding modules."""
    tower_bytes = sum(FLOAT * p.numel() for p in {id(p): p for p in user.parameters()}.values() if id(p) in in_tower)
    return max(0, dense_parameter_bytes(user) - tower_bytes)


def add_pipeline_flows(led: Ledger, layout: PipelineLayout) -> None:
    """Book one step of ``layout``'s collectives into the ledger ``led`` (per rank, per step,
    ``led.batch_size`` rows per rank): see the module doc for what and how. A row ``r`` of the
    ledger is pipeline rank ``r % S``: the job's rank ``r`` in one group; under
    ``sharding.replica_groups`` (rows: one sharding group's ranks) group rank ``r`` of every
    group, each pipeline lying inside a group (``stages.mesh_order``), so each row is exact for
    every group; the data-parallel all-reduce spans all ``dp`` pipelines of the job."""
    S, B, W = layout.ranks, led.batch_size, led.world_size
    d = layout.input_width
    for r in range(W):
        i = r % S  # pipeline rank
        io_sent = io_recv = (S - 1) * B * 2 * FLOAT  # the (label, weight) all_gather
        if layout.dp > 1:  # the global weight's all-reduce over the data-parallel group
            io_sent, io_recv = io_sent + FLOAT, io_recv + FLOAT
        pooled, result = B * d * FLOAT, S * B * FLOAT
        if i == 0:  # gathers the pooled embeddings, scatters their gradient
            io_sent, io_recv = io_sent + (S - 1) * pooled, io_recv + (S - 1) * pooled
        else:
            io_sent, io_recv = io_sent + pooled, io_recv + pooled
        if i == S - 1:  # broadcasts the logits
            io_sent += (S - 1) * result
        else:
            io_recv += result
        led.add(r, "pipeline_io", "pipeline", io_sent, io_recv)
        p2p_sent = p2p_recv = 0
        for k, w in enumerate(layout.widths[:-1]):  # stage k -> k + 1: activations, then gradients back
            b = S * B * w * FLOAT
            if layout.owner(k) == i:
                p2p_sent, p2p_recv = p2p_sent + b, p2p_recv + b
            if layout.owner(k + 1) == i:
                p2p_sent, p2p_recv = p2p_sent + b, p2p_recv + b
        led.add(r, "pipeline_p2p", "pipeline", p2p_sent, p2p_recv)
        own = sum(layout.parameters[k] for k in range(len(layout.starts)) if layout.owner(k) == i) * FLOAT
        reduce = (own if layout.dp > 1 else 0) + layout.rest_bytes
        led.add(r, "allreduce", "dense", reduce, reduce)
