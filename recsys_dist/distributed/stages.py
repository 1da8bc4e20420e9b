"""``distributed.dense.strategy: pipeline``: the dense tower cut into stages of
torch.distributed.pipelining, one per rank, the tables still sharded by TorchRec over every rank.

How a model is cut: :mod:`recsys_dist.models.tower`. How a step runs (the global batch to
stage 0, the pooled embeddings' gradient back to every rank, the two scalings):
:class:`recsys_dist.train.stage_pipeline.StagePipeline` and docs/design/pipeline.md.

A rank holds only its own stages' modules' parameters and buffers (rank 0's weights at the
start, as DDP): :func:`free_other_stages` drops the others' from the model right after the cut,
before the optimizer is built, so the dense optimizer, its state, the model's ``state_dict``
(each rank's checkpoint entries) and the gradients are its own stages' (plus the replicated
parameters outside the tower). The model's plain ``forward`` becomes :func:`scoring_forward`, a
forward-only pass through the stages (every rank in its pipeline's collectives), so evaluation,
``predict`` and metrics score the whole tower. A checkpoint holds every stage (each written by
its ranks) under the model's own names, so it moves between the strategies and world sizes.

Under ``sharding.replica_groups`` (TorchRec's ``ShardingEnv2D``, whose ``world_size`` / ``rank``
are a sharding group's) the grid spans the job's ranks, each pipeline inside one sharding group
(:func:`job_order`); the step is unchanged (docs/design/replica_groups.md).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper

from recsys_dist.distributed.config import DenseConfig
from recsys_dist.distributed.rules import pipeline_cut_problems
from recsys_dist.distributed.two_bw import TwoBW

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# Several stages per rank (distributed.dense.stages_per_rank), placed in a loop: rank r of a
# pipeline of S ranks holds stages r, r + S, ... (torch's default for these two).
MULTI_SCHEDULES = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zero_bubble": ScheduleInterleavedZeroBubble}

SCHEDULES["2bw"] = Schedule1F1B  # then wrapped in two_bw.TwoBW (PipelineDense.wrap, below)


def cut_model(task: nn.Module) -> tuple[list[nn.Module] | None, str]:
    """The tower of ``task`` (a ``CTRTask`` or the user's model itself), or None and why it cannot
    be cut: no ``pipeline_input`` / ``pipeline_tower`` (recsys_dist.models.tower), several
    tasks, managed-collision ids, batch norm (statistics per microbatch, not per rank batch), a
    parameter in two of the tower's modules (tied weights: two stages would each update a copy)."""
    user = getattr(task, "model", task)
    name = type(user).__name__
    if not callable(getattr(user, "pipeline_tower", None)) or not callable(getattr(user, "pipeline_input", None)):
        return None, (
            f"the model ({name}) does not say how its dense tower is cut (it has no pipeline_input / "
            "pipeline_tower methods, docs/design/pipeline.md); dcnv2, dlrm, dlrm_dcnv2 and hstu can be cut (not "
            "hstu_retrieval or sasrec_retrieval: their in-batch sampled softmax scores each row against the whole batch's items, which a "
            "stage sees one microbatch of)"
        )
    if getattr(task, "multi_task", False) or getattr(task, "remap", None) is not None:
        return None, "pipeline stages take one task without managed-collision ids (data.categorical_mapping)"
    try:
        tower = list(user.pipeline_tower())
    except ValueError as err:  # the model says why it cannot be cut (e.g. hstu: a history of unknown length)
        return None, str(err)
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for t in tower for m in t.modules()):
        return None, f"the tower of {name} has batch norm, whose statistics would be per microbatch; use model.norm"
    shared = _shared_parameters(tower)
    if shared:
        return None, (
            f"the tower of {name} holds a parameter in more than one of its modules ({shared}); each stage "
            "updates only its own modules' parameters, so a parameter used in two stages would get part of its "
            "gradient on each (tied weights); give pipeline_tower modules that share no parameter"
        )
    return tower, ""


def _shared_parameters(tower: list[nn.Module]) -> str:
    """The first parameter held by two of ``tower``'s modules, as ``"modules i and j"``, or ""."""
    owner: dict[int, int] = {}
    for i, module in enumerate(tower):
        for p in module.parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                return f"modules {j} and {i}"
    return ""


def split_auto(sizes: list[int], stages: int) -> list[int]:
    """Where to cut modules of ``sizes`` parameters into ``stages`` contiguous non-empty stages so
    that the largest stage holds as few parameters as it can (ties: the earliest cuts): the index
    of each stage's first module after the first stage's (``stages - 1`` ints).

    Raises:
        ValueError: fewer modules than stages.
    """
    n = len(sizes)
    if stages > n:
        raise ValueError(f"{n} modules cannot make {stages} stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the smallest largest-stage over the first i modules in k stages; cut[k][i]: its last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)[1:]


@dataclass
class DenseStages:
    """One rank's part of the pipeline: its stage and schedule, and which stage owns which module.

    Ranks form a ``data x pipeline`` grid (``dp = world / S`` rows, ``S`` ranks per pipeline):
    rank ``r`` is rank ``r % S`` of pipeline ``r // S``; with ``dp = 1`` the pipeline group is
    the world. Under ``sharding.replica_groups`` the grid is laid over the ranks in
    :func:`mesh_order` (each pipeline inside a sharding group) and ``r`` is a rank's place there.
    With ``per_rank = v`` stages per rank (the interleaved schedules) the tower is cut into
    ``S x v`` stages and pipeline rank ``i`` holds stages ``i, i + S, ..., i + (v-1) S``.

    Attributes:
        tower: the whole tower's modules (the model's, shared).
        starts: the index of each stage's first module (``[0, ...]``, one per stage, ``S x v``).
        index: this rank's rank in its pipeline group (with ``v = 1``, its stage).
        group: its pipeline's group (ranks ``[d*S, ..., d*S + S - 1]``, places in the order).
        dp_group: the group of the ranks that run the same stage (``[s, S + s, ...]``), or None
            (``dp = 1``): their stage gradients are averaged over it.
        dp: the pipelines (data-parallel degree).
        world_size: the job's ranks ``W`` (under ``sharding.replica_groups`` all groups', not the
            env's ``world_size``, which is one sharding group's).
        schedule: the torch schedule over this rank's ``PipelineStage``.
        microbatches: the schedule's microbatches per step.
        loss_scale: per step, ``microbatches x dp / the global batch's weight`` (set before ``step``).
        rest: the replicated dense parameters outside the tower (their gradients are averaged).
        freed: ``(module, attribute, model name, shape, dtype)`` of each parameter of the other
            stages' modules dropped from this rank (:func:`free_other_stages`); the attribute now
            holds a :class:`FreedTensor` (no memory; a use of it raises, naming it).
    """

    tower: list[nn.Module]
    starts: list[int]
    index: int
    group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None = None
    dp: int = 1
    schedule: object = None
    microbatches: int = 1
    loss_scale: float = 1.0
    rest: list[nn.Parameter] = field(default_factory=list)
    per_rank: int = 1
    world_size: int = 1
    freed: list[tuple[nn.Module, str, str, tuple, torch.dtype]] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        """Every stage of the pipeline (``S x per_rank``)."""
        return len(self.starts)

    @property
    def ranks(self) -> int:
        """The ranks of one pipeline (``S``)."""
        return self.num_stages // self.per_rank

    @property
    def owned(self) -> list[int]:
        """This rank's stages: ``index, index + S, ...``."""
        return [self.index + k * self.ranks for k in range(self.per_rank)]

    def owner(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        return stage % self.ranks

    def own_modules(self) -> list[nn.Module]:
        """The modules of this rank's stages."""
        return [m for s in self.owned for m in self.modules_of(s)]

    def modules_of(self, stage: int) -> list[nn.Module]:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else len(self.tower)
        return self.tower[self.starts[stage] : end]


class PipelineDense(DataParallelWrapper):
    """DMP's wrapper for ``distributed.dense.strategy: pipeline``: rank 0's dense weights on every
    rank (as DDP starts), then this rank's stage and schedule on ``dmp.dense_stages``, the other
    stages' weights freed (:func:`free_other_stages`) and the model's ``forward`` replaced by
    :func:`scoring_forward`. No DDP: a stage's parameters live on its ranks only. Unsharded parameters outside the tower (data-parallel
    tables) stay replicated; the step averages their gradients (``DenseStages.rest``).

    Raises (in ``wrap``):
        ValueError: the model cannot be cut, or has fewer tower modules than stages.
    """

    def __init__(self, cfg: DenseConfig) -> None:
        self.cfg = cfg

    def wrap(self, dmp: DistributedModelParallel, env, device: torch.device) -> None:
        root = dmp._dmp_wrapped_module.to(device)
        dmp._dmp_wrapped_module = root
        tower, why = cut_model(root)
        if tower is None:
            raise ValueError(f"distributed.dense.strategy: pipeline: {why}")
        cfg, world = self.cfg, env.process_group
        if env.world_size % cfg.stages:  # the env's: the job's, or under replica groups a sharding group's
            where = f"a sharding group's {env.world_size} ranks (sharding.replica_groups)" if order_is_2d(env) else ""
            raise ValueError(
                f"distributed.dense.stages: {cfg.stages} must divide {where or f'the world size {env.world_size}'}"
            )
        problems = pipeline_cut_problems(cfg, len(tower))  # a Trainer(model=...) model is checked here
        if problems:
            raise ValueError("; ".join(problems))
        sizes = [sum(p.numel() for p in m.parameters()) for m in tower]
        cuts = cfg.pipeline_virtual_stages
        starts = [0, *(split_auto(sizes, cuts) if cfg.split in (None, "auto") else cfg.split)]
        sharded = set(DistributedModelParallel._sharded_parameter_names(root))
        in_tower = {id(p) for m in tower for p in m.parameters()}
        rest = [p for n, p in root.named_parameters() if n not in sharded and id(p) not in in_tower and p.requires_grad]
        with torch.no_grad():  # rank 0's dense weights everywhere, as DDP starts
            for t in [*(p for n, p in root.named_parameters() if n not in sharded), *root.buffers()]:
                dist.broadcast(t.data, src=dist.get_global_rank(world, 0), group=world)
        order = job_order(env)
        group, dp_group = _grid(order, cfg.stages, dist.get_rank(), world)
        index = order.index(dist.get_rank()) % cfg.stages
        # torch places stage i on the pipeline group's rank i: a pipeline's ranks ascend in the order
        assert dist.get_rank(group) == index, (order, dist.get_process_group_ranks(group))
        stages = DenseStages(tower, starts, index, group, dp_group, len(order) // cfg.stages, rest=rest)
        stages.world_size = len(order)
        stages.per_rank = cfg.pipeline_stages_per_rank
        stages.microbatches = cfg.pipeline_microbatches
        stages.schedule = _schedule(cfg.pipeline_schedule, stages, device, _loss_fn(root, stages))
        if cfg.pipeline_schedule == "2bw":  # 1F1B's order on the previous weights
            names = {id(p): n for n, p in root.named_parameters()}
            own = [p for m in stages.modules_of(index) for p in m.parameters()]
            stages.schedule = TwoBW(stages.schedule, {names[id(p)]: p for p in own})
        free_other_stages(root, stages)
        user = getattr(root, "model", root)
        user.forward = functools.partial(scoring_forward, user, stages)  # an instance attribute, not a module
        dmp.dense_stages = stages


def _schedule(name: str, stages: DenseStages, device: torch.device, loss_fn):
    """The torch schedule ``name`` over this rank's ``PipelineStage`` (one per stage it owns,
    each an ``nn.Sequential`` of the stage's modules), averaging the stage gradients over the
    microbatches (``scale_grads``)."""
    owned = [
        PipelineStage(nn.Sequential(*stages.modules_of(s)), s, stages.num_stages, device, group=stages.group)
        for s in stages.owned
    ]
    if name in MULTI_SCHEDULES:
        return MULTI_SCHEDULES[name](owned, stages.microbatches, loss_fn=loss_fn, scale_grads=True)
    return SCHEDULES[name](owned[0], stages.microbatches, loss_fn=loss_fn, scale_grads=True)


def _grid(order: list[int], stages: int, rank: int, world: dist.ProcessGroup):
    """(this rank's pipeline group, its data-parallel group or None) of the ``data x pipeline``
    grid laid over the job's ranks in ``order`` (:func:`job_order`): pipeline ``d`` is
    ``order[d*S : d*S + S]``; with one pipeline, the world itself. Every rank creates every group
    (torch needs it)."""
    if len(order) == stages:
        return world, None
    dp, at = len(order) // stages, order.index(rank)
    pipes = [dist.new_group([order[d * stages + s] for s in range(stages)]) for d in range(dp)]
    replicas = [dist.new_group([order[d * stages + s] for d in range(dp)]) for s in range(stages)]
    return pipes[at // stages], replicas[at % stages]


def mesh_order(world_size: int, replica_groups: int = 1) -> list[int]:
    """The job's ranks in the order the pipelines are laid over them: ``0 .. W-1`` in one group;
    under ``sharding.replica_groups`` N, DMPCollection's sharding groups one after the other
    (``[0, N, 2N, ...], [1, N + 1, ...], ...``: rank ``k + j N`` is rank ``j`` of group ``k``), so
    that, stages dividing a group's W / N ranks, each pipeline lies inside one sharding group and
    a rank's pipeline rank is its group rank modulo the stages, the same in every group (the
    ledger's and ``recsys-dist plan``'s rows are one group's ranks)."""
    n = replica_groups
    return [k + j * n for k in range(n) for j in range(world_size // n)]


def order_is_2d(env) -> bool:
    """Whether ``env`` is TorchRec's ``ShardingEnv2D`` (``sharding.replica_groups`` > 1)."""
    return getattr(getattr(env, "device_mesh", None), "ndim", 1) == 2


def job_order(env) -> list[int]:
    """:func:`mesh_order` as ``env`` has it: under TorchRec's ``ShardingEnv2D`` (whose
    ``world_size`` / ``rank`` are a sharding group's, ``process_group`` the job's) its device
    mesh's rows (the sharding groups) one after the other; else the job's ranks in order."""
    if order_is_2d(env):
        return [int(r) for r in env.device_mesh.mesh.flatten().tolist()]
    pg = env.process_group
    return [dist.get_global_rank(pg, i) for i in range(dist.get_world_size(pg))]


def _loss_fn(task: nn.Module, stages: DenseStages):
    """The last stage's loss of one microbatch: the task's loss (a weighted mean over its rows)
    times the microbatch's weight x ``stages.loss_scale`` (microbatches x dp / global weight), so
    that the mean over the microbatches, which the schedule's gradients are, averaged over the dp
    pipelines, is the weighted mean over the global batch whatever rows are padding.
    ``target``: ``[b, 2]`` (label, weight)."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = output.squeeze(-1).float()
        weights = target[:, 1]
        return task.loss(logits, target[:, 0], weights) * (weights.sum() * stages.loss_scale)

    return loss


class FreedTensor(torch.Tensor):
    """What a dropped parameter or buffer of another stage's module reads as on this rank (a meta
    tensor: no memory): any use raises, naming it. (A plain meta tensor is not enough: torch 2.13
    computes ``cpu_tensor @ meta_tensor.T`` into uninitialised memory without an error.)"""

    freed_name = "?"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = next((a.freed_name for a in (*args, *(kwargs or {}).values()) if isinstance(a, FreedTensor)), "?")
        raise RuntimeError(
            f"distributed.dense.strategy: pipeline: {name} belongs to a stage another rank holds; this rank "
            "freed it (each rank holds only its own stages' weights). Score through the model's forward "
            "(evaluate / predict), or read the whole model from a checkpoint or checkpoint.gather.gather_full_state"
        )


def _freed(t: torch.Tensor, name: str) -> FreedTensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="meta").as_subclass(FreedTensor)
    out.freed_name = name
    return out


def free_other_stages(root: nn.Module, stages: DenseStages) -> None:
    """Drop the parameters and buffers of the modules of the stages this rank does not hold from
    ``root`` (every module that registers them: the tower's and the model's own), so that they are
    freed and neither ``root.named_parameters()`` (the optimizer), ``root.state_dict()`` (a
    checkpoint) nor ``root.parameters()`` sees them. Each attribute becomes a :class:`FreedTensor`
    (no memory; a use of it raises, naming it). Parameters also in an owned module or outside the
    tower (``stages.rest``) are kept."""
    own = [*stages.own_modules()]
    keep = {id(t) for m in own for t in (*m.parameters(), *m.buffers())}
    others = [m for s in range(stages.num_stages) if s not in stages.owned for m in stages.modules_of(s)]
    drop = {id(t) for m in others for t in (*m.parameters(), *m.buffers())} - keep
    if not drop:
        return
    user = getattr(root, "model", root)
    names = {id(t): n for n, t in (*user.named_parameters(remove_duplicate=False), *user.named_buffers())}
    modules = dict.fromkeys([*root.modules(), *(m for t in stages.tower for m in t.modules())])
    for module in modules:
        for table in (module._parameters, module._buffers):
            for attr, t in list(table.items()):
                if t is None or id(t) not in drop:
                    continue
                del table[attr]
                name = names.get(id(t), attr)
                object.__setattr__(module, attr, _freed(t, name))
                if isinstance(t, nn.Parameter):
                    stages.freed.append((module, attr, name, tuple(t.shape), t.dtype))


@contextlib.contextmanager
def probing(stages: DenseStages):
    """While entered, each freed parameter of ``stages`` reads as zeros of its shape (one
    element, expanded) whose gradient, if a computation uses it, lands in the yielded dict's
    tensors (model name -> a 0-dim leaf): the first step's check that ``pipeline_input`` uses
    no parameter of the tower (a rank that does not hold it would otherwise fail alone and leave
    the others waiting in a collective). The :class:`FreedTensor` entries are back on exit."""
    leaves: dict[str, torch.Tensor] = {}
    saved = [module.__dict__[attr] for module, attr, *_ in stages.freed]
    for module, attr, name, shape, dtype in stages.freed:
        leaf = leaves.setdefault(name, torch.zeros((), dtype=dtype, requires_grad=True))
        object.__setattr__(module, attr, leaf.expand(shape))
    try:
        yield leaves
    finally:
        for (module, attr, *_), freed in zip(stages.freed, saved, strict=True):
            object.__setattr__(module, attr, freed)


def scoring_forward(user: nn.Module, stages: DenseStages, dense: torch.Tensor, kjt) -> torch.Tensor:
    """The model's ``forward`` under pipeline (set on the model by ``PipelineDense.wrap``): its
    ``pipeline_input``, then the tower through the stages, forward only. Collective: every rank
    of a pipeline calls it together (as the tables' lookup already requires), whatever its rows
    (padding too). Returns this rank's ``[B, ...]`` output (the tower's last module's), without
    a graph into the tower (training goes through ``StagePipeline``: a backward from it fails)."""
    x = user.pipeline_input(dense, kjt)
    with torch.no_grad():
        return run_stages(stages, x.detach())


def run_stages(stages: DenseStages, x: torch.Tensor) -> torch.Tensor:
    """Every pipeline rank's ``x`` (``[B_r, d]``) through the tower's stages, forward only:
    stage 0's rank takes the pipeline's rows (gathered, each rank's padded to the largest B_r),
    each stage's rank runs its modules, the activation is broadcast to the pipeline from each
    stage whose next stage another rank holds, and the last stage's output to every rank.
    Returns this rank's rows of the output. Collective over ``stages.group``."""
    group, me, size = stages.group, stages.index, stages.ranks
    counts = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(size)]  # on the backend's device
    dist.all_gather(counts, torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device), group=group)
    rows = [int(c) for c in counts]
    top = max(rows)
    padded = torch.zeros(top, *x.shape[1:], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(size)] if me == 0 else None
    dist.gather(padded, parts, dst=dist.get_global_rank(group, 0), group=group)
    h = torch.cat(parts) if me == 0 else None
    for s in range(stages.num_stages):
        if stages.owner(s) == me:
            for module in stages.modules_of(s):
                h = module(h)
        last = s == stages.num_stages - 1
        if last or stages.owner(s + 1) != stages.owner(s):
            h = _share(h, stages.owner(s), group, x)
    return h[me * top : me * top + x.shape[0]]


def _share(t: torch.Tensor | None, src: int, group, like: torch.Tensor) -> torch.Tensor:
    """``t`` of pipeline rank ``src`` on every rank of ``group`` (its shape first, then its
    values; dtype and device those of ``like``)."""
    header = torch.zeros(8, dtype=torch.int64, device=like.device)
    if t is not None and dist.get_rank(group) == src:
        header[0] = t.dim()
        header[1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64, device=like.device)
    dist.broadcast(header, src=dist.get_global_rank(group, src), group=group)
    shape = header[1 : 1 + int(header[0])].tolist()
    out = t.contiguous() if dist.get_rank(group) == src else torch.empty(shape, dtype=like.dtype, device=like.device)
    dist.broadcast(out, src=dist.get_global_rank(group, src), group=group)
    return out
