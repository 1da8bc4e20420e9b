"""2-D sparse parallelism (``sharding.replica_groups``): tables sharded within groups of
world / N ranks and replicated across the N groups, through TorchRec's ``DMPCollection``.

The ranks form a mesh ``[[0, N, 2N, ...], [1, N + 1, ...], ...]``: each row is a sharding group
(the tables are planned for its size, ``Topology(world_size=world / N)``, and every group holds
the same plan on its own ranks), each column a replica group (the ranks holding the same
shard). The all-to-alls run inside a sharding group only; :meth:`ReplicaDMP.sync` averages every
table shard (FBGEMM TBE weights) and its optimizer's ``sum`` state over the replica group
(``allreduce_coalesced``, AVG). The dense tower stays data parallel over all ranks of the job
(``distributed.dense.strategy`` ddp: TorchRec's DDP on the global group; fsdp:
:class:`~recsys_dist.distributed.dense.FSDPDense` over it), as it would in one group.

What is exact (docs/design/replica_groups.md): TorchRec divides the pooled embeddings' gradients
by the group's size, so with ``exact_sgd`` synced every step the average over the replicas is
the 1-D run's update (same losses to float rounding). Adagrad's accumulators are averaged,
which is not the accumulator of the summed gradient: close, not equal. Syncing every k > 1 steps
is local SGD (replicas drift between syncs).

``DMPCollection`` refuses CPU as shipped; :class:`ReplicaDMP` makes two documented changes and
nothing else (see its docstring).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection
from torchrec.distributed.types import EnumerableShardingSpec, ShardingPlan

from recsys_dist.distributed.optim import EMBEDDING_OPTIMIZERS
from recsys_dist.distributed.rules import REPLICA_OPTIMIZERS


class _Accelerator:
    """Stands in for a CPU ``torch.device`` for exactly one read: the ``device.type`` of
    ``DMPCollection.__init__``'s first statement (``assert device.type in ("cuda", "mtia")``).
    :meth:`ReplicaDMP._create_process_groups` (called next) and :class:`_RealDevice` put the
    real device back before anything else reads it."""

    type = "cuda"

    def __init__(self, real: torch.device) -> None:
        self.real = real


def _real(device) -> torch.device:
    return device.real if isinstance(device, _Accelerator) else device


class _RealDevice(DistributedModelParallel):
    """Between DMPCollection and DistributedModelParallel in :class:`ReplicaDMP`'s MRO:
    DMPCollection's ``super().__init__(module, env, device, ...)`` lands here and gets the real
    device back."""

    def __init__(self, module, env=None, device=None, *args, **kwargs) -> None:
        super().__init__(module, env, _real(device), *args, **kwargs)


class ReplicaDMP(DMPCollection, _RealDevice):
    """TorchRec's ``DMPCollection`` on CPU as well (gloo), with two changes:

    1. its first statement refuses any device but CUDA / MTIA; on CPU the device is passed as
       :class:`_Accelerator` for that one check (nothing in the collection is CUDA-specific on
       the default strategy: DeviceMesh, the process groups and ``allreduce_coalesced`` run on
       gloo);
    2. ``_remap_sharding_plan`` writes shard placements ``rank:R/cpu:L``, which ShardedTensor
       refuses on CPU (a CPU tensor's device is ``cpu``, not ``cpu:L``); they become ``rank:R/cpu``.

    Args:
        module: the model, built on ``meta``, its tables' fused optimizer set.
        device: the rank's device.
        plan: planned for ``group_size`` ranks and broadcast to all (``collective_plan``);
            remapped in place onto this rank's sharding group.
        groups: the number of replica groups N (``sharding.replica_groups``), >= 2, dividing the world.
        pg: the global process group (DDP or FSDP of the dense tower runs on it).
        sync_every: :meth:`stepped` syncs every this many steps (``sharding.replica_sync_every``).
        **kwargs: DistributedModelParallel's ``sharders``, ``data_parallel_wrapper``, ...
    """

    def __init__(
        self,
        module,
        device: torch.device,
        plan: ShardingPlan,
        groups: int,
        pg: dist.ProcessGroup,
        sync_every: int = 1,
        **kwargs,
    ) -> None:
        world = dist.get_world_size(pg)
        optimizer = fused_optimizer_name(module)
        if optimizer is not None and optimizer not in REPLICA_OPTIMIZERS:
            raise ValueError(
                f"sharding.replica_groups: {groups}: the tables' fused optimizer {optimizer} keeps state the "
                f"replicas' sync cannot average; use one of {list(REPLICA_OPTIMIZERS)} (train.embedding_optimizer)"
            )
        group_plan = copy.deepcopy(plan)  # DMPCollection remaps ``plan`` onto this rank's group in place
        passed = device if device.type in ("cuda", "mtia") else _Accelerator(device)
        super().__init__(
            module,
            passed,  # type: ignore[arg-type]
            plan,
            world_size=world,
            sharding_group_size=world // groups,
            global_pg=pg,
            **kwargs,
        )
        self.sync_every = sync_every
        self.steps_since_sync = 0  # optimizer steps whose updates the replicas have not averaged
        self.replica_groups = groups
        self.group_plan = group_plan  # the plan on group ranks 0 .. world / groups - 1 (the ledger's)
        self.embedding_optimizer = optimizer

    def _create_process_groups(self, *args, **kwargs):
        self._device = _real(self._device)
        return super()._create_process_groups(*args, **kwargs)

    def _remap_sharding_plan(self, plan: ShardingPlan, *args, **kwargs) -> None:
        super()._remap_sharding_plan(plan, *args, **kwargs)
        if self._device.type != "cpu":
            return
        for module_plan in plan.plan.values():
            for ps in module_plan.values():  # type: ignore[union-attr]
                if isinstance(ps.sharding_spec, EnumerableShardingSpec):
                    for shard in ps.sharding_spec.shards:
                        shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")

    @property
    def replica_pg(self) -> dist.ProcessGroup:
        """The ranks holding the same shards as this one (the column of the mesh)."""
        return self._default_ctx.replica_pg

    def sync(self, include_optimizer_state: bool = True) -> None:
        """Average every table shard (and its optimizer's ``sum`` state) over the replica group.
        Collective over all ranks (each replica group at once)."""
        super().sync(include_optimizer_state)
        self.steps_since_sync = 0

    def settle(self) -> None:
        """:meth:`sync` if any step trained since the last one: the replicas agree after it
        (before an evaluation, a checkpoint, an export). Collective; every rank has trained the
        same steps, so every rank decides alike."""
        if self.steps_since_sync:
            self.sync()

    def stepped(self) -> None:
        """One optimizer step done: sync when ``sync_every`` steps have run since the last sync."""
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.sync_every:
            self.sync()


def fused_optimizer_name(module) -> str | None:
    """``train.embedding_optimizer``'s name of the fused optimizer marked on ``module``'s tables
    (``apply_optimizer_in_backward``, :func:`recsys_dist.distributed.optim.fuse_embedding_optimizer`),
    None when none is marked or it is not one of those."""
    for p in module.parameters():
        for cls in getattr(p, "_optimizer_classes", None) or []:
            for name, (known, _) in EMBEDDING_OPTIMIZERS.items():
                if cls is known:
                    return name
    return None


def settle(model) -> None:
    """Let the replicas of a :class:`ReplicaDMP` agree (:meth:`ReplicaDMP.settle`); nothing for
    any other model."""
    if isinstance(model, ReplicaDMP):
        model.settle()


def stepped(model) -> None:
    """A training step of ``model`` done: a :class:`ReplicaDMP` syncs when its
    ``sync_every`` steps have run (:meth:`ReplicaDMP.stepped`); nothing for any other model."""
    if isinstance(model, ReplicaDMP):
        model.stepped()


def wrap(model, device: torch.device, plan: ShardingPlan, s, pg: dist.ProcessGroup | None = None, **kwargs):
    """``model`` sharded by ``plan``: a :class:`ReplicaDMP` over ``s.replica_groups`` replica
    groups of ``pg`` (default: the world), syncing every ``s.replica_sync_every`` steps, when
    ``s`` (the ``sharding`` section) asks for more than one; else TorchRec's
    DistributedModelParallel. ``kwargs``: DMP's ``sharders``, ``data_parallel_wrapper``."""
    if not s.replicated:
        return DistributedModelParallel(model, device=device, plan=plan, **kwargs)
    return ReplicaDMP(model, device, plan, s.replica_groups, pg or dist.group.WORLD, s.replica_sync_every, **kwargs)
