"""The public :func:`shard`: plan and wrap your own model in DistributedModelParallel."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsys_dist.distributed import replicas
from recsys_dist.distributed import tables as state
from recsys_dist.distributed.config import (
    CUDA_ONLY_KERNELS,
    DEFAULT_PLANNER_BATCH_SIZE,
    PLANNER_KEYS,
    ShardingConfig,
)
from recsys_dist.distributed.ids import ids_check_hook
from recsys_dist.distributed.plan import World, checked_tables, plan
from recsys_dist.distributed.sharders import fix_replicated_sequence_tables, sharders


def shard(
    model: nn.Module,
    sharding: ShardingConfig | dict | None = None,
    *,
    device: torch.device | None = None,
    batch_size: int | None = None,
    pg: dist.ProcessGroup | None = None,
    seed: int = 0,
    init_tables: bool = True,
    check_ids: bool = True,
) -> DistributedModelParallel:
    """Shard any ``nn.Module`` holding TorchRec EmbeddingBagCollections (pooled tables) and
    EmbeddingCollections (unpooled, per-position tables); returns a DMP.

    Plans as the trainer does (:func:`recsys_dist.distributed.plan.plan`: ``sharding.fixed_plan``
    as it says, else TorchRec's planner on the process group, every sharding type allowed on
    CPU too, rank 0 plans and broadcasts), then wraps the model in ``DistributedModelParallel``:
    tables are sharded, everything else is data-parallel (DDP). Build the model on ``meta`` so
    no table memory is allocated before sharding, and call ``apply_optimizer_in_backward`` on
    the tables first to choose their fused optimizer (default: SGD, lr 0.01). Every rank of
    ``pg`` must call this with the same arguments.

    Every key of ``sharding`` takes effect or is refused: the planner's keys (refused, with
    ``batch_size``, under ``fixed_plan``: no planner runs) go to it, its constraints and its
    topology (``hbm_gb`` on CUDA only); ``comms`` goes to the sharders (bf16 on CUDA only).

    Args:
        model: e.g. a model with an ``EmbeddingBagCollection`` submodule; table names unique.
        sharding: the ``sharding:`` config section (a ShardingConfig or a plain dict), e.g.
            ``{"sharding_types": ["row_wise"]}`` or ``{"fixed_plan": {"t_user": {"sharding_type":
            "table_wise", "ranks": [1]}, ...}}``. None = planner's choice.
        device: compute device (default: cuda:LOCAL_RANK when available, else cpu).
        batch_size: per-rank batch size of the planner's cost estimates (default:
            ``sharding.planner_batch_size``, else 512; both, different, is an error).
        pg: process group (default: the world; it must already be initialised).
        seed: seed of the initial table weights (see ``init_tables``).
        init_tables: initialise every table as the trainer does
            (``recsys_dist.distributed.tables.init_tables``): uniform(-m, m), m the table's
            ``weight_init_max`` (TorchRec's default sqrt(1 / num_embeddings) when unset), drawn
            per (seed, table index, row chunk): the same at every world size and sharding, and
            the trainer's for the same tables and seed. False keeps TorchRec's per-shard
            initialisation (it depends on the sharding), e.g. to load your own weights next.
        check_ids: refuse ids outside ``[0, num_embeddings)`` of their table, in a forward
            pre-hook on the DMP (``recsys_dist.distributed.ids.ids_check_hook``; FBGEMM would
            read row 0 and only log). It sees a KJT passed to the DMP (positional or keyword)
            or as a batch's ``.sparse_features`` (as TrainPipelineSparseDist calls it), not one
            nested deeper nor ids the model changes before its tables: pass False then. Cost:
            one comparison and one host sync per call. Under a pipeline the error is raised on
            the rank holding the bad id only: treat it as fatal for the job.

    Returns:
        ``DistributedModelParallel`` (``sharding.replica_groups`` > 1: ``replicas.ReplicaDMP``; call its ``stepped()``
        after each step); ``.plan``: the plan used. Each EmbeddingBagCollection returns its pooled KeyedTensor, each
        EmbeddingCollection its dict, in the unsharded module's key order (:mod:`recsys_dist.distributed.key_order`).

    Raises:
        pydantic.ValidationError: a bad ``sharding`` section (a ValueError too).
        ValueError: before any collective, naming the key: the rules of ``plan`` (``per_table``
            or ``fixed_plan`` naming a table the model lacks, a ``fixed_plan`` missing a table
            or using a rank >= the world size, comms the device cannot carry, small tables only
            row-wise, sequence tables without a type), a key without effect, a CUDA-only kernel
            or ``hbm_gb`` off CUDA, a model without collections, one holding another embedding
            module, duplicate table names, a table's init range ``init_tables`` cannot draw;
            after planning, column shards not multiples of 4 wide. From the DMP's calls
            (``check_ids``): an id out of range, naming the feature, the id and the table's size.
    """
    s = sharding if isinstance(sharding, ShardingConfig) else ShardingConfig.model_validate(sharding or {})
    device = device or _default_device()
    tables = checked_tables(model, s)  # before the process group is asked anything
    planner_batch = check_shard_config(s, device.type, batch_size)
    if init_tables:
        _check_init_range(tables)
    sharding_plan = plan(model, s, World.of_group(pg or dist.group.WORLD, device.type), planner_batch)
    dmp = replicas.wrap(model, device, sharding_plan, s, pg, sharders=sharders(s.comms, device.type))
    fix_replicated_sequence_tables(dmp)
    if init_tables:
        state.init_tables(dmp.state_dict(), tables, seed, {t.name: t.get_weight_init_max() for t in tables})
    if check_ids:
        dmp.register_forward_pre_hook(ids_check_hook(tables), with_kwargs=True)
    return dmp


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    return torch.device("cpu")


def check_shard_config(s: ShardingConfig, device_type: str, batch_size: int | None) -> int:
    """Refuse every key of ``s`` that :func:`shard` could not honour on ``device_type`` (the
    keys' rules with the model's tables and the world are ``plan``'s); returns the planner's
    batch size (0 under a fixed plan). Needs no process group.

    Raises:
        ValueError: naming the key (``sharding.<key>``) and why.
    """
    if s.fixed_plan is not None:
        _check_fixed_plan_keys(s, device_type, batch_size)
        return 0
    kernels = [("sharding.compute_kernels", k) for k in s.compute_kernels] + [
        (f"sharding.per_table.{n}.compute_kernels", k) for n, t in s.per_table.items() for k in t.compute_kernels
    ]
    if device_type != "cuda":
        cuda_only = sorted({key for key, k in kernels if k in CUDA_ONLY_KERNELS})
        if cuda_only:
            raise ValueError(
                f"{', '.join(cuda_only)}: fused_uvm / fused_uvm_caching need a CUDA device (this is "
                f"{device_type}); use fused"
            )
        if s.hbm_gb is not None:
            raise ValueError(
                f"sharding.hbm_gb: device memory, which the planner counts on CUDA only (this is "
                f"{device_type}); use sharding.ddr_gb"
            )
    if s.cache_load_factor is not None and not any(k == "fused_uvm_caching" for _, k in kernels):
        raise ValueError(
            "sharding.cache_load_factor: only used by the fused_uvm_caching kernel, which no "
            "sharding.compute_kernels / sharding.per_table.*.compute_kernels allows"
        )
    if batch_size is not None and s.planner_batch_size is not None and batch_size != s.planner_batch_size:
        raise ValueError(
            f"sharding.planner_batch_size: {s.planner_batch_size} but batch_size={batch_size} was passed; "
            "give one of them"
        )
    return batch_size or s.planner_batch_size or DEFAULT_PLANNER_BATCH_SIZE


def _check_fixed_plan_keys(s: ShardingConfig, device_type: str, batch_size: int | None) -> None:
    """Under a fixed plan: no planner setting, no batch size, no CUDA-only kernel off CUDA."""
    default = ShardingConfig()
    ignored = [k for k in PLANNER_KEYS if getattr(s, k) != getattr(default, k)]
    if ignored:
        raise ValueError(
            f"sharding.{', sharding.'.join(ignored)}: planner settings, without effect under "
            "sharding.fixed_plan; remove them or the fixed_plan"
        )
    if batch_size is not None:
        raise ValueError("batch_size: the planner's cost estimate, without effect under sharding.fixed_plan")
    for name, fp in (s.fixed_plan or {}).items():
        if device_type != "cuda" and fp.compute_kernel in CUDA_ONLY_KERNELS:
            raise ValueError(
                f"sharding.fixed_plan.{name}.compute_kernel: {fp.compute_kernel} needs a CUDA device "
                f"(this is {device_type}); use fused"
            )


def _check_init_range(tables: list[BaseEmbeddingConfig]) -> None:
    """Refuse a table whose initialisation ``init_tables`` would not reproduce (uniform(-m, m) only)."""
    for t in tables:
        lo, hi = t.get_weight_init_min(), t.get_weight_init_max()
        default_fn = (
            isinstance(t.init_fn, functools.partial)
            and t.init_fn.func is torch.nn.init.uniform_
            and t.init_fn.keywords == {"a": lo, "b": hi}
        )
        if lo != -hi or not default_fn:
            raise ValueError(
                f"table {t.name}: init_tables draws uniform(-weight_init_max, weight_init_max), but the "
                f"table asks for {'its own init_fn' if lo == -hi else f'[{lo:g}, {hi:g}]'}; pass "
                "init_tables=False to keep TorchRec's initialisation"
            )
