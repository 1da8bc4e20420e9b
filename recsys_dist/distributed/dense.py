"""The dense tower's layout over the ranks (``distributed.dense.strategy``), one entry per name.

TorchRec's DistributedModelParallel (DMP) shards the tables, then hands the model to a
``DataParallelWrapper`` for everything else. Each strategy here is such a wrapper:

- ``ddp``: TorchRec's default (DistributedDataParallel over every unsharded parameter); at
  world size 1 :class:`~recsys_dist.distributed.sharders.OneRankDense` (no DDP to pay for).
- ``fsdp``: :class:`FSDPDense`: every dense block (a submodule holding no table) is
  ``torch.distributed.fsdp.fully_shard``-ed over a 1-D data-parallel mesh of all ranks of the
  job, under ``sharding.replica_groups`` too (FSDP2:
  its parameters become ``DTensor`` s sharded on dim 0; each rank keeps ~1/world of them, their
  gradients and so their optimizer state). Unsharded parameters outside any such block (the
  weights of data-parallel tables, a parameter set directly on a module that also holds tables)
  stay replicated under DDP, as under ``ddp``.

- ``pipeline``: :class:`~recsys_dist.distributed.stages.PipelineDense` (the tower cut into
  pipeline stages, one per rank).

A new layout is one more entry of :data:`WRAPPERS` and of
``recsys_dist.distributed.config.DenseStrategy``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper, DefaultDataParallelWrapper
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_dist.distributed.config import DENSE_STRATEGIES, DenseConfig
from recsys_dist.distributed.sharders import OneRankDense
from recsys_dist.distributed.stages import PipelineDense

_TABLES = (EmbeddingBagCollection, EmbeddingCollection, ShardedModule)


def dense_blocks(model: nn.Module, skip: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """Split the parameters of ``model`` outside its tables into blocks to shard and the rest.

    A block is the largest submodule on a path from ``model`` that holds parameters and no
    embedding collection (sharded or not) and none of ``skip`` (parameter names), and that has a
    forward of its own: a container (``ModuleList``, ``ModuleDict``, ``ParameterList``, ...) is
    never called, so FSDP's hooks on it would never gather its weights (torch refuses
    ``fully_shard`` on the module ones); its children are blocks instead. Returns
    (the blocks' module names, in ``named_modules`` order; the names of the parameters in no
    block and outside every embedding collection: those set directly on a module that also
    holds a table, or on a container). A model that is one dense block itself gives ``[""]``.
    """
    skip = set(skip)
    blocks: list[str] = []
    rest: list[str] = []

    def holds_tables(m: nn.Module, prefix: str) -> bool:
        if type(m).forward is nn.Module.forward:  # a container: see above
            return True
        if any(isinstance(x, _TABLES) for x in m.modules()):
            return True
        return any(f"{prefix}{n}" in skip for n, _ in m.named_parameters())

    def visit(m: nn.Module, prefix: str) -> None:
        if isinstance(m, _TABLES):
            return
        if not holds_tables(m, prefix):
            if any(True for _ in m.parameters()):
                blocks.append(prefix.rstrip("."))
            return
        rest.extend(f"{prefix}{n}" for n, _ in m.named_parameters(recurse=False) if f"{prefix}{n}" not in skip)
        for name, child in m.named_children():
            visit(child, f"{prefix}{name}.")

    visit(model, "")
    return blocks, rest


class FSDPDense(DataParallelWrapper):
    """DMP's wrapper for ``distributed.dense.strategy: fsdp``: ``fully_shard`` on each dense block
    (:func:`dense_blocks`) over a 1-D mesh of all ranks of ``env.process_group`` (the job's, also
    under TorchRec's 2-D env of ``sharding.replica_groups``, whose ``world_size`` is a sharding
    group's), then DDP over any unsharded parameter left outside the blocks (data-parallel
    tables' weights), as TorchRec's default wrapper does.

    The state dict keeps its keys (FSDP2 works in place); dense values become ``DTensor`` s
    (``Shard(0)``), which DCP checkpoints, ``full_tensor()`` and the optimizers handle.
    Build the dense optimizer after DMP (from ``dmp.named_parameters()``): the parameters are
    replaced by the wrap.
    """

    def wrap(self, dmp: DistributedModelParallel, env, device: torch.device) -> None:
        root = dmp._dmp_wrapped_module.to(device)
        dmp._dmp_wrapped_module = root
        sharded = set(DistributedModelParallel._sharded_parameter_names(root))
        blocks, _ = dense_blocks(root, sharded)
        if not blocks:
            raise ValueError(
                "distributed.dense.strategy: fsdp: the model has no dense module to shard (every parameter is a "
                "table's); use distributed.dense.strategy: ddp"
            )
        if "" in blocks:
            raise ValueError("distributed.dense.strategy: fsdp: the model holds no embedding table; use ddp")
        # Every rank of the job, never env.world_size: under sharding.replica_groups (TorchRec's
        # ShardingEnv2D) that is one sharding group's, while env.process_group stays the job's, as
        # for the DDP TorchRec puts over the dense tower there (docs/design/replica_groups.md).
        world = dist.get_world_size(env.process_group)
        mesh = DeviceMesh.from_group(env.process_group, device.type, mesh_dim_names=("dp",))
        # Parameters of no elements (DeepFM's dense_linear without dense features: [1, 0]) have
        # nothing to shard or reduce, and FSDP2's reduce-scatter fails on them (_chunk_cat expects
        # non-empty tensor): left out of FSDP and DDP alike, plain tensors on every rank.
        empty = {n for n, p in root.named_parameters() if p.numel() == 0}
        for name in blocks:
            block = root.get_submodule(name)
            if world > 1:
                _broadcast_states(block, env.process_group)
            # The blocks are disjoint, so each is an FSDP root, which torch's default (None) keeps
            # unsharded from forward to backward anyway; said here because the ledger counts on it
            # (one all-gather per block per step: ALL_GATHERS_PER_STEP).
            ignored = {p for p in block.parameters() if p.numel() == 0}
            fully_shard(block, mesh=mesh, reshard_after_forward=False, ignored_params=ignored or None)
        fsdp_names = {n for n, p in root.named_parameters() if isinstance(p, DTensor)}
        if world > 1:
            # Nothing left (no data-parallel table): no DDP at all (TorchRec's _ddp_wrap returns).
            DefaultDataParallelWrapper()._ddp_wrap(dmp, env, device, sharded | fsdp_names | empty)


@torch.no_grad()
def _broadcast_states(module: nn.Module, group) -> None:
    """Rank 0's parameters and buffers of ``module`` on every rank, as DDP starts (each rank
    keeps its slice of its own copy: the copies must be equal)."""
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=dist.get_global_rank(group, 0), group=group)


def _ddp(world_size: int, cfg: DenseConfig) -> DataParallelWrapper | None:
    return OneRankDense() if world_size == 1 else None  # None: TorchRec's DefaultDataParallelWrapper


WRAPPERS: dict[str, Callable[[int, DenseConfig], DataParallelWrapper | None]] = {
    "ddp": _ddp,
    "fsdp": lambda world_size, cfg: FSDPDense(),
    "pipeline": lambda world_size, cfg: PipelineDense(cfg),
}
assert set(WRAPPERS) == set(DENSE_STRATEGIES), "recsys_dist.distributed.config.DenseStrategy and WRAPPERS differ"


def dense_wrapper(strategy: str, world_size: int, cfg: DenseConfig | None = None) -> DataParallelWrapper | None:
    """The ``data_parallel_wrapper`` to give DistributedModelParallel for ``strategy``
    (``distributed.dense.strategy``) at ``world_size`` ranks (None: TorchRec's default DDP);
    ``cfg``: the whole ``distributed.dense`` section (pipeline reads its stages and schedule).

    Raises:
        ValueError: an unknown strategy, naming the key and the known ones.
    """
    if strategy not in WRAPPERS:
        raise ValueError(f"distributed.dense.strategy: {strategy!r} is not one of {', '.join(WRAPPERS)}")
    return WRAPPERS[strategy](world_size, cfg if cfg is not None else DenseConfig(strategy=strategy))


def is_ddp_wrapped(dmp: nn.Module) -> bool:
    """Whether DMP put the model (or its unsharded rest) into DistributedDataParallel."""
    return isinstance(getattr(dmp, "_dmp_wrapped_module", None), DistributedDataParallel)


def local_dense_bytes(dmp: nn.Module) -> dict[str, int]:
    """This rank's bytes of the dense tower: ``parameters`` (the local shard of a DTensor, the
    whole tensor otherwise), ``gradients`` (the same, for those with a gradient now) and
    ``optimizer`` is not known here (see :func:`optimizer_state_bytes`). Tables are left out."""
    params = dense_parameters(dmp)
    return {
        "parameters": sum(_local(p).numel() * p.element_size() for p in params),
        "gradients": sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
    }


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> int:
    """This rank's bytes of ``optimizer``'s tensor state for ``params`` (local shards of DTensors)."""
    total = 0
    for p in params:
        for v in optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += _local(v).numel() * v.element_size()
    return total


# Optimizer state per dense parameter element (train.dense_optimizer; torch's defaults: SGD
# without momentum keeps none).
_STATE_PER_ELEMENT = {"sgd": 0, "adagrad": 1, "adam": 2, "adamw": 2}


def planned_dense_bytes(model: nn.Module, strategy: str, world_size: int, dense_optimizer: str) -> list[dict]:
    """Per rank, the bytes of the dense tower of ``model`` (built on any device, meta too) under
    ``strategy``: ``parameters``, ``gradients`` and ``optimizer`` (``dense_optimizer``'s state).

    ddp: every rank the whole tower. fsdp: each block parameter cut on dim 0 as FSDP2 does
    (``torch.chunk``: ``ceil(rows / world)`` rows per rank, the last ranks fewer or none); a
    parameter outside every block (:func:`dense_blocks`) whole on every rank. Tables are left out.
    """
    blocks, rest = dense_blocks(model)
    named = dict(model.named_parameters())
    shapes = [(p.shape, p.element_size(), True) for b in blocks for p in model.get_submodule(b).parameters()]
    shapes += [(named[n].shape, named[n].element_size(), False) for n in rest]
    per_rank = []
    for rank in range(world_size):
        total = 0
        for shape, size, sharded in shapes:
            numel = math.prod(shape)
            if sharded and strategy == "fsdp" and len(shape) > 0:
                rows = -(-shape[0] // world_size)
                own = max(0, min(rows, shape[0] - rank * rows))
                numel = own * math.prod(shape[1:])
            total += numel * size
        per_rank.append(
            {"parameters": total, "gradients": total, "optimizer": total * _STATE_PER_ELEMENT[dense_optimizer]}
        )
    return per_rank


# Each block's weights are all-gathered once per training step (in its forward; FSDPDense does
# not reshard after forward), its gradients reduce-scattered once (in its backward).
ALL_GATHERS_PER_STEP = 1


def fsdp_traffic(model: nn.Module, world_size: int) -> tuple[int, list[tuple[int, int]]]:
    """What one training step under ``fsdp`` at ``world_size`` ranks moves for the dense tower of
    ``model`` (plain, meta or DMP-wrapped): (fp32 bytes DDP all-reduces: the gradients of the
    parameters in no block; per block, the bytes of one rank's chunk of its all-gather and of its
    reduce-scatter).

    A chunk is what FSDP2 sends: each parameter padded on dim 0 to a multiple of ``world_size``
    (``ceil(rows / world)`` rows from every rank, zeros past the last row), in its element size;
    the all-gather carries every parameter of the block, the reduce-scatter those that need a
    gradient. Tables (embedding collections, sharded or not) are left out.
    """
    base = getattr(model, "module", model)  # DMP: its module is the user model (FSDP2 works in place)
    blocks, rest = dense_blocks(base)
    named = dict(base.named_parameters())
    allreduce = sum(named[n].numel() * 4 for n in rest if named[n].requires_grad)
    chunks = []
    for name in blocks:
        sizes = [
            (-(-p.shape[0] // world_size) * math.prod(p.shape[1:]) * p.element_size(), p.requires_grad)
            for p in base.get_submodule(name).parameters()
        ]
        chunks.append((sum(b for b, _ in sizes), sum(b for b, grad in sizes if grad)))
    return allreduce, chunks


def dense_parameters(dmp: nn.Module) -> list[nn.Parameter]:
    model = getattr(dmp, "module", dmp)
    table_params = {id(p) for m in model.modules() if isinstance(m, _TABLES) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in table_params and p.requires_grad]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
