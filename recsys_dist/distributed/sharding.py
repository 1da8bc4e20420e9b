"""Sharding glue: sharders that offer every sharding type on CPU, the planner, the plan.

TorchRec's ``EmbeddingBagCollectionSharder`` reports only data_parallel, table_wise,
column_wise and table_column_wise on CPU, although row_wise and table_row_wise train
correctly over gloo. :class:`EmbeddingBagCollectionSharderAllTypes` reports them all,
so the planner (and our tests) can use every type on CPU.

Unpooled (sequence) tables live in ``EmbeddingCollection`` modules and are sharded by
TorchRec's ``EmbeddingCollectionSharder``, which offers data_parallel, table_wise,
column_wise and row_wise (:data:`SEQUENCE_SHARDING_TYPES`) on every device. Any other
embedding module (``nn.Embedding``, ``nn.EmbeddingBag``, a managed-collision collection) is
refused by :func:`check_covered` (before any rank starts: ``preflight.coverage_problems``; and at
plan time): DMP would otherwise replicate it silently.

Both sharders build the sharded collections of :mod:`recsys_dist.distributed.key_order`, whose outputs
keep the unsharded module's key order (TorchRec's come back ordered by sharding type and rank),
so a model reading ``kt.values()`` by position computes the same sharded and unsharded.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.types import CacheParams, ModuleSharder, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig

from recsys_dist.config.base import ConfigError
from recsys_dist.config.base import Section as _Section
from recsys_dist.distributed.key_order import OrderedEmbeddingBagCollectionSharder, OrderedEmbeddingCollectionSharder

if TYPE_CHECKING:
    from torchrec.distributed import DistributedModelParallel

SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
)
ShardingTypeName = Literal[
    "data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"
]
ComputeKernelName = Literal["dense", "fused", "fused_uvm", "fused_uvm_caching"]
CUDA_ONLY_KERNELS = ("fused_uvm", "fused_uvm_caching")


class TableConstraint(_Section):
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=list, description="Sharding types the planner may choose for this table."
    )
    compute_kernels: list[ComputeKernelName] = Field(
        default_factory=list, description="Compute kernels the planner may choose for this table."
    )


class FixedPlacement(_Section):
    sharding_type: ShardingTypeName = Field(description="How this table is sharded.")
    ranks: list[int] | None = Field(
        None,
        description="table_wise: one rank; column_wise: the rank of each column shard (may repeat); "
        "row_wise / data_parallel: ignored (all ranks); table_row_wise: the ranks of one node.",
    )
    compute_kernel: ComputeKernelName | None = Field(
        None, description="None = dense for data_parallel, fused otherwise."
    )

    @model_validator(mode="after")
    def _check(self) -> FixedPlacement:
        if self.sharding_type == "table_column_wise":
            raise ValueError(
                "table_column_wise is not available in a fixed plan; use column_wise with ranks on one node"
            )
        if self.sharding_type in ("table_wise", "column_wise", "table_row_wise") and not self.ranks:
            raise ValueError(f"{self.sharding_type} needs ranks, e.g. ranks: [0]")
        if self.sharding_type == "table_wise" and len(self.ranks or []) != 1:
            raise ValueError(f"table_wise needs exactly one rank, got {self.ranks}")
        if any(r < 0 for r in self.ranks or []):
            raise ValueError(f"ranks must be >= 0, got {self.ranks}")
        return self


Precision = Literal["fp32", "fp16", "bf16"]


class CommsConfig(_Section):
    """``sharding.comms``: element type of output_dist's pooled embeddings on the wire
    (TorchRec's QCommsConfig, encoded and decoded by FBGEMM's quantized-comm codecs around
    the all-to-all and the reduce-scatter; the lookup itself stays fp32)."""

    forward: Precision = Field("fp32", description="Pooled embeddings in output_dist's forward: fp32, fp16 or bf16.")
    backward: Precision = Field("fp32", description="Their gradients in output_dist's backward: fp32, fp16 or bf16.")


class ShardingConfig(_Section):
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=list,
        description="Sharding types allowed for every table (empty = all six).",
    )
    compute_kernels: list[ComputeKernelName] = Field(
        default_factory=lambda: ["fused", "dense"],
        description="Kernels allowed for every table: dense (data_parallel only), fused (FBGEMM "
        "table-batched, weights in device memory), and on CUDA fused_uvm (weights in host "
        "memory) and fused_uvm_caching (host memory with a device cache).",
    )
    planner_batch_size: int | None = Field(
        None, gt=0, description="Per-rank batch size the planner's cost model assumes (None = train.batch_size)."
    )
    cache_load_factor: float | None = Field(
        None, gt=0, le=1, description="fused_uvm_caching: fraction of each table's rows cached on device."
    )
    per_table: dict[str, TableConstraint] = Field(
        default_factory=dict, description="Overrides by table name (t_<feature>, w_<feature> for first-order tables)."
    )
    storage_reservation: float = Field(
        0.15, ge=0, lt=1, description="Fraction of each rank's memory the planner keeps free."
    )
    fixed_plan: dict[str, FixedPlacement] | None = Field(
        None,
        description="Place every table by hand instead of planning (table -> sharding_type, ranks). "
        "`recsys-dist train --plan RUN_DIR/plan.json` fills it from an earlier run.",
    )
    hbm_gb: float | None = Field(None, gt=0, description="Device memory per rank in GB (None = TorchRec's 32 GB).")
    ddr_gb: float | None = Field(None, gt=0, description="Host memory per rank in GB (None = TorchRec's 128 GB).")
    intra_node_bandwidth_gbps: float | None = Field(
        None, gt=0, description="Bandwidth between ranks of one node in GB/s (None = TorchRec's 600)."
    )
    inter_node_bandwidth_gbps: float | None = Field(
        None, gt=0, description="Bandwidth between nodes per rank in GB/s (None = TorchRec's 12.5)."
    )
    comms: CommsConfig = Field(
        default_factory=CommsConfig,
        description="Quantized output_dist: fp16 / bf16 halve the bytes of the pooled embeddings "
        "(forward) and their gradients (backward); bf16 needs CUDA (NCCL), gloo carries fp16 only.",
    )


ALL_TYPES = [ShardingType(t).value for t in SHARDING_TYPES]


class EmbeddingBagCollectionSharderAllTypes(OrderedEmbeddingBagCollectionSharder):
    """EBC sharder offering every sharding type on every device, CPU included; its pooled
    KeyedTensor has the unsharded module's key order (:mod:`recsys_dist.distributed.key_order`)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(ALL_TYPES)


class OneRankDense(DataParallelWrapper):
    """DMP's data-parallel wrapper for a world of one rank: the dense modules stay as they are
    (moved to the device) instead of going into DistributedDataParallel, whose per-step
    bucketing and all-reduce have nothing to synchronise there. State-dict keys are the same
    either way (DMP unwraps DDP), so checkpoints move between world sizes as before."""

    def wrap(self, dmp, env, device: torch.device) -> None:
        if env.world_size != 1:
            raise ValueError(f"OneRankDense is for a world of one rank, not {env.world_size}")
        dmp._dmp_wrapped_module = dmp._dmp_wrapped_module.to(device)


# The sharding types TorchRec's EmbeddingCollectionSharder offers (on every device).
SEQUENCE_SHARDING_TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise")


def fix_replicated_sequence_tables(dmp: nn.Module) -> int:
    """Make data-parallel EmbeddingCollection tables on CPU return one row per id.

    TorchRec runs replicated (data_parallel) EmbeddingCollection tables through FBGEMM's
    ``DenseTableBatchedEmbeddingBagsCodegen`` with ``PoolingMode.NONE``; FBGEMM-CPU 1.8
    ignores the mode and sum-pools (``[B, T*E]`` instead of ``[ids, E]``), so the sharded
    module fails in its output (or, with matching sizes, is silently wrong). This replaces the
    forward of each such CPU lookup (in place, once) by a plain-torch gather from the same
    ``weights`` parameter: the gradient is dense, DDP averages it, and the replicated-table
    optimizer steps it, as for data-parallel EmbeddingBagCollection tables. CUDA lookups and
    every other sharding type are left as they are. Returns how many lookups were changed.
    """
    import types

    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbedding

    # Sharded collections keep their lookups in a plain list, outside modules().
    # (Other modules, e.g. TorchRec's managed-collision modules, use the name for a tensor.)
    found = [
        m
        for owner in dmp.modules()
        if isinstance(getattr(owner, "_lookups", None), (list, nn.ModuleList))
        for lookup in owner._lookups
        if isinstance(lookup, nn.Module)
        for m in lookup.modules()
    ]
    changed = 0
    for module in found:
        emb = getattr(module, "_emb_module", None)
        if (
            isinstance(module, BatchedDenseEmbedding)
            and emb is not None
            and emb.weights.device.type == "cpu"
            and emb.pooling_mode == PoolingMode.NONE
            and not getattr(module, "_recsys_dist_unpooled", False)
        ):
            module.forward = types.MethodType(_unpooled_dense_forward, module)
            module._recsys_dist_unpooled = True
            changed += 1
    return changed


def _unpooled_dense_forward(self, features) -> torch.Tensor:
    """[sum of lengths, E]: each id's row of its feature's table (features in the lookup's order)."""
    weights, bounds = self._emb_module.weights, self._emb_module.weights_physical_offsets
    tables = [
        weights[bounds[t] : bounds[t + 1]].view(rows, cols)
        for t, (rows, cols) in enumerate(zip(self._local_rows, self._local_cols))
    ]
    per_key = features.values().split(features.length_per_key())
    rows = [torch.nn.functional.embedding(ids.long(), tables[t]) for ids, t in zip(per_key, self._feature_table_map)]
    return torch.cat(rows) if rows else weights.new_zeros(0, self._local_cols[0] if self._local_cols else 0)


def check_covered(model: nn.Module, module_sharders: list[ModuleSharder[nn.Module]] | None = None) -> None:
    """Refuse a model holding an embedding module that no sharder covers.

    DistributedModelParallel shards only modules whose exact type a sharder names; any
    other module goes into data-parallel (DDP) as it is, so an ``nn.Embedding`` table would
    be materialised in full on every rank and all-reduced every step. The children of a
    covered collection (its own ``nn.EmbeddingBag`` / ``nn.Embedding`` tables) are covered
    with it.

    Raises:
        ValueError: names the module's path and type, and what to use instead.
    """
    from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, EmbeddingCollectionInterface

    covered = tuple(s.module_type for s in (module_sharders or sharders()))
    embedding_like = (nn.Embedding, nn.EmbeddingBag, EmbeddingBagCollectionInterface, EmbeddingCollectionInterface)
    if type(model) in covered:  # a collection passed on its own
        return
    inside: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue
        if type(module) in covered:
            inside.append(path)
            continue
        torchrec_embedding = (
            type(module).__module__.startswith("torchrec.modules") and "Embedding" in type(module).__name__
        )
        if isinstance(module, embedding_like) or torchrec_embedding:
            raise ValueError(
                f"{path or type(model).__name__} is a {type(module).__module__}.{type(module).__name__}, which no "
                "sharder covers: it would be replicated in full on every rank. Put pooled tables in a "
                "torchrec EmbeddingBagCollection and per-position (sequence) tables in a torchrec "
                "EmbeddingCollection; a small dense lookup (e.g. positions) can be an nn.Parameter indexed directly"
            )


def comms_problems(comms: CommsConfig, device_type: str, world_size: int | None = None) -> list[str]:
    """Why ``sharding.comms`` cannot run on ``device_type`` in a job of ``world_size`` ranks
    (when known; empty when it can).

    TorchRec's ``get_qcomm_codecs_registry`` does not carry bf16 over gloo: on CPU it
    replaces bf16 by fp16 with a log warning. A job of 1 rank sends nothing between ranks:
    measured, fp16 comms there give the fp32 run's numbers to the last bit. Refusing both
    keeps the config honest."""
    problems = []
    if world_size == 1 and (comms.forward, comms.backward) != ("fp32", "fp32"):
        problems.append(
            "sharding.comms: a job of 1 rank sends nothing between ranks (its output_dist stays in the "
            "process), so there is nothing to quantize; remove sharding.comms or run on more ranks"
        )
    if device_type == "cuda":
        return problems
    return problems + [
        f"sharding.comms.{key}: bf16 comms need CUDA (NCCL); TorchRec's gloo/CPU codecs carry fp32 and "
        "fp16 only (they would silently send fp16); use fp16 on CPU"
        for key in ("forward", "backward")
        if getattr(comms, key) == "bf16"
    ]


def qcomm_codecs_registry(comms: CommsConfig | None, device_type: str):
    """TorchRec's qcomm codec registry for ``sharding.comms`` (None for fp32 both ways).

    Raises:
        ValueError: a precision the device's codecs cannot carry (see :func:`comms_problems`).
    """
    if comms is None or (comms.forward, comms.backward) == ("fp32", "fp32"):
        return None
    problems = comms_problems(comms, device_type)
    if problems:
        raise ValueError("; ".join(problems))
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    return get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType(comms.forward), backward_precision=CommType(comms.backward)),
        device=torch.device(device_type),
    )


def sharders(comms: CommsConfig | None = None, device_type: str = "cpu") -> list[ModuleSharder[nn.Module]]:
    """The sharders of every run: EmbeddingBagCollection (all six types) and EmbeddingCollection
    (:data:`SEQUENCE_SHARDING_TYPES`), with quantized output_dist codecs when ``comms`` asks
    for them."""
    registry = qcomm_codecs_registry(comms, device_type)
    return [
        EmbeddingBagCollectionSharderAllTypes(qcomm_codecs_registry=registry),
        OrderedEmbeddingCollectionSharder(qcomm_codecs_registry=registry),
    ]


def leaves_rank_empty(rows: int, ranks: int) -> bool:
    """Whether row-wise sharding of ``rows`` rows over ``ranks`` ranks gives some rank no row.

    TorchRec cuts ``ceil(rows / ranks)``-row blocks (``_calculate_rw_shard_sizes_and_offsets``:
    5 rows on 4 ranks are 2, 2, 1, 0), and FBGEMM's fused kernel fails on a rank whose shard
    of a table is empty; so such a table must not be sharded row-wise."""
    return ranks > 1 and (ranks - 1) * -(-rows // ranks) >= rows


def row_wise_types(rows: int, world_size: int, local_world_size: int) -> list[str]:
    """The row-sharded types (row_wise, table_row_wise) that would leave a rank without a row
    of a ``rows``-row table (see :func:`leaves_rank_empty`)."""
    out = []
    if leaves_rank_empty(rows, world_size):
        out.append("row_wise")
    if leaves_rank_empty(rows, local_world_size):
        out.append("table_row_wise")
    return out


def small_table_problems(
    s: ShardingConfig, sizes: dict[str, int], world_size: int, local_world_size: int | None = None
) -> list[str]:
    """Tables too small to be sharded row-wise over the job's ranks that the config leaves no
    other sharding type (or places row-wise in a fixed plan), one message per table naming the fix.

    ``sizes``: table name -> rows."""
    local = local_world_size or world_size
    problems = []
    for name, rows in sizes.items():
        bad = row_wise_types(rows, world_size, local)
        if not bad:
            continue
        if s.fixed_plan is not None:
            fp = s.fixed_plan.get(name)
            if fp is not None and fp.sharding_type in bad:
                problems.append(
                    f"sharding.fixed_plan.{name}: {fp.sharding_type} over {world_size if fp.sharding_type == 'row_wise' else local} "
                    f"ranks leaves a rank without a row of this {rows}-row table, which FBGEMM cannot run; "
                    "place it table_wise or data_parallel"
                )
            continue
        override = s.per_table.get(name)
        key = (
            f"sharding.per_table.{name}.sharding_types"
            if override and override.sharding_types
            else ("sharding.sharding_types")
        )
        types = (override and override.sharding_types) or s.sharding_types or list(ALL_TYPES)
        if not [t for t in types if t not in bad]:
            problems.append(
                f"{key}: {types} leaves table {name} ({rows} rows) only {' / '.join(bad)}, which over "
                f"{world_size} ranks gives a rank no row of it (FBGEMM cannot run that); allow table_wise or "
                f"data_parallel for it (sharding.per_table.{name}.sharding_types: [table_wise]), give it at least "
                f"{world_size} rows, or use fewer ranks"
            )
    return problems


def constraints(
    cfg, tables: list[EmbeddingBagConfig], world_size: int | None = None, local_world_size: int | None = None
) -> dict[str, ParameterConstraints]:
    """Per-table planner constraints of a run config: its ``sharding`` section (per_table wins)
    and ``data.multi_hot_sizes`` (pooling factors of the ``t_`` tables and their first-order twins).

    With ``world_size``, a table too small to give every rank a row is not offered row_wise
    (table_row_wise: over ``local_world_size`` ranks), see :func:`leaves_rank_empty`.

    Raises:
        ConfigError: such a table is left no other sharding type (:func:`small_table_problems`).
    """
    hot = cfg.data.multi_hot_sizes
    by_feature = dict(zip([t.feature_names[0] for t in tables if t.name.startswith("t_")], hot)) if hot else {}
    sizes = [by_feature.get(t.feature_names[0], 1) for t in tables] if hot else None
    out = table_constraints(cfg.sharding, [t.name for t in tables], sizes, unpooled_names(tables))
    if world_size is not None:
        local = local_world_size or world_size
        rows = {t.name: t.num_embeddings for t in tables}
        problems = small_table_problems(cfg.sharding, rows, world_size, local)
        if problems:
            raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))
        for name, c in out.items():
            bad = row_wise_types(rows[name], world_size, local)
            if bad:
                c.sharding_types = [t for t in c.sharding_types if t not in bad]
    return out


def unpooled_names(tables: list[BaseEmbeddingConfig]) -> set[str]:
    """Names of the EmbeddingCollection (unpooled, ``EmbeddingConfig``) tables among ``tables``."""
    return {t.name for t in tables if isinstance(t, EmbeddingConfig)}


def unpooled_type_problems(s: ShardingConfig, unpooled: list[str] | set[str]) -> list[str]:
    """Why the ``sharding`` section cannot place the EmbeddingCollection (unpooled) tables
    ``unpooled`` (empty when it can): a table whose allowed types (``per_table``, else
    ``sharding_types``; empty = all) or ``fixed_plan`` placement include none that TorchRec's
    EmbeddingCollectionSharder offers (:data:`SEQUENCE_SHARDING_TYPES`). Each problem is
    "dotted.key: what is wrong; the fix"."""
    problems = []
    for name in sorted(unpooled):
        fixed = (s.fixed_plan or {}).get(name)
        if fixed is not None:
            if fixed.sharding_type not in SEQUENCE_SHARDING_TYPES:
                problems.append(
                    f"sharding.fixed_plan.{name}.sharding_type: {fixed.sharding_type}, but {name} is an "
                    f"EmbeddingCollection (sequence) table, which TorchRec shards {list(SEQUENCE_SHARDING_TYPES)} "
                    "only; use one of them"
                )
            continue
        if s.fixed_plan is not None:  # the fixed plan must place every table: checked with the model's tables
            continue
        override = s.per_table.get(name)
        types = (override and override.sharding_types) or s.sharding_types or list(ALL_TYPES)
        if not any(t in SEQUENCE_SHARDING_TYPES for t in types):
            key = (
                f"sharding.per_table.{name}.sharding_types"
                if override and override.sharding_types
                else "sharding.sharding_types"
            )
            problems.append(
                f"{key}: {list(types)} leaves the EmbeddingCollection (sequence) table {name} no sharding type; "
                f"TorchRec shards unpooled tables {list(SEQUENCE_SHARDING_TYPES)} only: add one of them "
                f"(e.g. sharding.per_table.{name}.sharding_types: [row_wise])"
            )
    return problems


def table_constraints(
    s: ShardingConfig,
    names: list[str],
    multi_hot_sizes: list[int] | None = None,
    unpooled: set[str] | frozenset[str] = frozenset(),
) -> dict[str, ParameterConstraints]:
    """Planner constraints for tables ``names`` from a ``sharding`` config section. Tables in
    ``unpooled`` (EmbeddingCollection tables) get the allowed types that TorchRec's
    EmbeddingCollectionSharder offers (:data:`SEQUENCE_SHARDING_TYPES`).

    Raises:
        ValueError: ``sharding.per_table`` names a table the model does not have; the allowed
            types leave an unpooled table none its sharder offers.
    """
    unknown = sorted(set(s.per_table) - set(names))
    if unknown:
        raise ValueError(f"sharding.per_table: unknown tables {unknown}; tables are {names[0]} .. {names[-1]}")
    hot = multi_hot_sizes
    out = {}
    for i, name in enumerate(names):
        override = s.per_table.get(name)
        types = (override and override.sharding_types) or s.sharding_types or list(ALL_TYPES)
        if name in unpooled:
            problems = unpooled_type_problems(s.model_copy(update={"fixed_plan": None}), [name])
            if problems:
                raise ValueError(problems[0])
            types = [t for t in types if t in SEQUENCE_SHARDING_TYPES]
        kernels = (override and override.compute_kernels) or s.compute_kernels
        cache = CacheParams(load_factor=s.cache_load_factor) if s.cache_load_factor else None
        out[name] = ParameterConstraints(
            sharding_types=list(types),
            compute_kernels=list(kernels),
            pooling_factors=[float(hot[i])] if hot else [1.0],
            cache_params=cache,
        )
    return out


def make_topology(cfg, world_size: int, local_world_size: int, compute_device: str) -> Topology:
    """TorchRec's Topology for a ``sharding`` section (or a run config holding one)."""
    s = getattr(cfg, "sharding", cfg)
    gb = 1024**3
    kwargs = {}
    if s.hbm_gb:
        kwargs["hbm_cap"] = int(s.hbm_gb * gb)
    if s.ddr_gb:
        kwargs["ddr_cap"] = int(s.ddr_gb * gb)
    # TorchRec's bandwidths are in bytes per millisecond.
    if s.intra_node_bandwidth_gbps:
        kwargs["intra_host_bw"] = s.intra_node_bandwidth_gbps * gb / 1000
    if s.inter_node_bandwidth_gbps:
        kwargs["inter_host_bw"] = s.inter_node_bandwidth_gbps * gb / 1000
    return Topology(world_size=world_size, local_world_size=local_world_size, compute_device=compute_device, **kwargs)


class OrderedEnumerator(EmbeddingEnumerator):
    """TorchRec's enumerator with each table's sharding types and compute kernels in the
    sharder's order. TorchRec intersects them as Python sets, whose order follows the process's
    string-hash seed, and the planner keeps the first of options that tie on cost: two equal
    runs of the 2-rank quickstart were planned row_wise in one and table_row_wise in the other."""

    def _filter_sharding_types(self, name: str, allowed_sharding_types: list[str], *args, **kwargs) -> list[str]:
        found = super()._filter_sharding_types(name, allowed_sharding_types, *args, **kwargs)
        return sorted(found, key=_order(allowed_sharding_types))

    def _filter_compute_kernels(self, name: str, allowed_compute_kernels: list[str], *args, **kwargs) -> list[str]:
        found = super()._filter_compute_kernels(name, allowed_compute_kernels, *args, **kwargs)
        return sorted(found, key=_order(allowed_compute_kernels))


def _order(allowed: list[str]):
    """Sort key: the position in ``allowed``, then the name (for anything not in it)."""
    return lambda x: (allowed.index(x) if x in allowed else len(allowed), x)


def planner(topology: Topology, batch_size: int, constraints: dict, reservation: float) -> EmbeddingShardingPlanner:
    """TorchRec's planner with :class:`OrderedEnumerator`: the same inputs give the same plan in every process."""
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        storage_reservation=HeuristicalStorageReservation(percentage=reservation),
        enumerator=OrderedEnumerator(topology=topology, batch_size=batch_size, constraints=constraints),
    )


def make_planner(
    cfg,
    tables: list[EmbeddingBagConfig],
    world_size: int,
    local_world_size: int,
    compute_device: str,
    batch_size: int | None = None,
) -> EmbeddingShardingPlanner:
    return planner(
        make_topology(cfg, world_size, local_world_size, compute_device),
        batch_size or cfg.sharding.planner_batch_size or cfg.train.batch_size,
        constraints(cfg, tables, world_size, local_world_size),
        cfg.sharding.storage_reservation,
    )


def fixed_sharding_plan(
    model: nn.Module, fixed: dict, world_size: int, local_world_size: int, device_type: str
) -> ShardingPlan:
    """A ShardingPlan placing each table as ``sharding.fixed_plan`` says (no planner).

    Raises:
        ValueError: a rank outside the job, or table_row_wise ranks spanning two nodes.
    """
    from torchrec.distributed import sharding_plan as sp
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    plan = {}
    for path, module in model.named_modules():
        if isinstance(module, EmbeddingBagCollection):
            sharder, configs = EmbeddingBagCollectionSharderAllTypes(), module.embedding_bag_configs()
        elif isinstance(module, EmbeddingCollection):
            sharder, configs = OrderedEmbeddingCollectionSharder(), module.embedding_configs()
        else:
            continue
        per_table = {}
        for t in configs:
            fp = fixed[t.name]
            ranks = list(fp.ranks or [])
            if isinstance(module, EmbeddingCollection) and fp.sharding_type not in SEQUENCE_SHARDING_TYPES:
                raise ValueError(
                    f"sharding.fixed_plan.{t.name}.sharding_type: {fp.sharding_type}, but {t.name} is an "
                    f"EmbeddingCollection table, which TorchRec shards {list(SEQUENCE_SHARDING_TYPES)} only"
                )
            if any(r >= world_size for r in ranks):
                raise ValueError(f"sharding.fixed_plan.{t.name}.ranks: {ranks} but the job has {world_size} rank(s)")
            kernel = fp.compute_kernel or ("dense" if fp.sharding_type == "data_parallel" else "fused")
            if fp.sharding_type == "data_parallel":
                gen = sp.data_parallel()
            elif fp.sharding_type == "table_wise":
                gen = sp.table_wise(rank=ranks[0], compute_kernel=kernel)
            elif fp.sharding_type == "row_wise":
                if leaves_rank_empty(t.num_embeddings, world_size):
                    raise ValueError(
                        f"sharding.fixed_plan.{t.name}: row_wise over {world_size} ranks leaves a rank without a "
                        f"row of this {t.num_embeddings}-row table, which FBGEMM cannot run; place it table_wise "
                        "or data_parallel"
                    )
                gen = sp.row_wise(compute_kernel=kernel)
            elif fp.sharding_type == "column_wise":
                width = t.embedding_dim / len(ranks)
                if width != int(width) or int(width) % 4:
                    ok = [n for n in range(1, t.embedding_dim // 4 + 1) if t.embedding_dim % (4 * n) == 0]
                    raise ValueError(
                        f"sharding.fixed_plan.{t.name}: {t.embedding_dim} columns over {len(ranks)} shards gives "
                        f"width {width:g}; FBGEMM's fused kernel needs shard widths that are multiples of 4: "
                        f"use {ok} shards"
                    )
                gen = sp.column_wise(ranks=ranks, compute_kernel=kernel)
            else:  # table_row_wise
                hosts = {r // local_world_size for r in ranks}
                if len(hosts) != 1:
                    raise ValueError(
                        f"sharding.fixed_plan.{t.name}: table_row_wise ranks {ranks} span nodes {sorted(hosts)}"
                    )
                gen = sp.table_row_wise(host_index=hosts.pop())
            per_table[t.name] = gen
        plan[path] = sp.construct_module_sharding_plan(
            module,
            per_table,
            sharder=sharder,
            local_size=local_world_size,
            world_size=world_size,
            device_type=device_type,
        )
    return ShardingPlan(plan)


def check_column_shards(plan: ShardingPlan) -> None:
    """Refuse a plan whose column shards are not multiples of 4 wide (FBGEMM would assert).

    Raises:
        ValueError: names the table, its shard widths and what to change.
    """
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            if ps.sharding_spec is None or ps.compute_kernel == "dense":
                continue
            widths = [s.shard_sizes[1] for s in ps.sharding_spec.shards]
            if any(w % 4 for w in widths):
                raise ValueError(
                    f"table {table}: {ps.sharding_type} shards of widths {widths}; FBGEMM's fused kernel needs "
                    f"multiples of 4. Use an embedding_dim that is a multiple of 4 per shard, or leave "
                    f"column_wise / table_column_wise out of sharding.per_table.{table}.sharding_types"
                )


def load_plan_file(path: str) -> dict:
    """``plan.json`` of an earlier run -> a ``sharding.fixed_plan`` mapping.

    Raises:
        ValueError: the file is not a plan.json (a list of table placements).
    """
    import json

    try:
        rows = json.loads(open(path).read())
        return {
            r["table"]: {
                "sharding_type": r["sharding_type"],
                "ranks": r["ranks"] or None,
                "compute_kernel": r["compute_kernel"],
            }
            for r in rows
        }
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--plan {path}: not a readable plan.json ({err})") from None


def collective_plan(
    cfg,
    model: nn.Module,
    tables: list[EmbeddingBagConfig],
    device: torch.device,
    pg: dist.ProcessGroup,
) -> ShardingPlan:
    """The fixed plan from the config, or a planner's plan made on rank 0 and broadcast.

    Raises:
        ValueError: the model holds an embedding module no sharder covers (:func:`check_covered`).
    """
    check_covered(model)
    world = dist.get_world_size(pg)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # Every rank checks (same tables, same answer) before rank 0 plans, so none waits alone.
    problems = small_table_problems(cfg.sharding, {t.name: t.num_embeddings for t in tables}, world, local)
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))
    if cfg.sharding.fixed_plan is not None:
        plan = fixed_sharding_plan(model, cfg.sharding.fixed_plan, world, local, device.type)
        check_column_shards(plan)
        return plan
    planner = make_planner(cfg, tables, world, local, device.type)
    plan = planner.collective_plan(model, sharders(cfg.sharding.comms, device.type), pg)
    check_column_shards(plan)
    return plan


def plan_summary(plan: ShardingPlan, tables: list[EmbeddingBagConfig] | None = None) -> list[dict]:
    """Machine-readable plan: one entry per table with type, kernel, ranks and, per rank,
    the bytes of fp32 weights it holds (``rank_bytes``; replicas count on every rank;
    data-parallel sizes need ``tables``)."""
    shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in tables or []}
    rows = []
    for module_path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            shard_ranks = (
                [s.placement.rank() for s in ps.sharding_spec.shards] if ps.sharding_spec else list(ps.ranks or [])
            )
            # Column shards keep their order (a rank may hold several); others list each rank once.
            ranks = shard_ranks if "column" in ps.sharding_type else list(dict.fromkeys(shard_ranks))
            rank_bytes: dict[int, int] = {}
            if ps.sharding_spec:
                for sh in ps.sharding_spec.shards:
                    r = sh.placement.rank()
                    rank_bytes[r] = rank_bytes.get(r, 0) + sh.shard_sizes[0] * sh.shard_sizes[1] * 4
            elif table in shapes:
                rank_bytes = {r: shapes[table][0] * shapes[table][1] * 4 for r in ranks}
            rows.append(
                {
                    "module": module_path,
                    "table": table,
                    "sharding_type": ps.sharding_type,
                    "compute_kernel": ps.compute_kernel,
                    "ranks": ranks,
                    "rank_bytes": {str(r): b for r, b in sorted(rank_bytes.items())},
                }
            )
    return rows


# ShardingConfig keys that only steer the planner: a fixed plan leaves them without effect.
PLANNER_KEYS = (
    "sharding_types",
    "compute_kernels",
    "planner_batch_size",
    "cache_load_factor",
    "per_table",
    "storage_reservation",
    "hbm_gb",
    "ddr_gb",
    "intra_node_bandwidth_gbps",
    "inter_node_bandwidth_gbps",
)
DEFAULT_PLANNER_BATCH_SIZE = 512


def model_tables(model: nn.Module) -> list[BaseEmbeddingConfig]:
    """The tables of every EmbeddingBagCollection (``EmbeddingBagConfig``) and
    EmbeddingCollection (``EmbeddingConfig``) in ``model``, in module order.

    Raises:
        ValueError: two collections hold tables of the same name (names key the plan).
    """
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    tables: list[BaseEmbeddingConfig] = []
    for m in model.modules():
        if isinstance(m, EmbeddingBagCollection):
            tables += m.embedding_bag_configs()
        elif isinstance(m, EmbeddingCollection):
            tables += m.embedding_configs()
    names = [t.name for t in tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tables {dup} appear in more than one EmbeddingBagCollection; table names must be unique")
    return tables


def check_shard_config(s: ShardingConfig, names: list[str], device_type: str, batch_size: int | None) -> int:
    """Refuse every key of ``s`` that :func:`shard` could not honour for tables ``names``;
    returns the planner's batch size (0 under a fixed plan). Needs no process group: a fixed plan's ranks are checked
    against the world size by :func:`fixed_sharding_plan`.

    Raises:
        ValueError: naming the key (``sharding.<key>``) and why.
    """
    default = ShardingConfig()
    if s.fixed_plan is not None:
        ignored = [k for k in PLANNER_KEYS if getattr(s, k) != getattr(default, k)]
        if ignored:
            raise ValueError(
                f"sharding.{', sharding.'.join(ignored)}: planner settings, without effect under "
                "sharding.fixed_plan; remove them or the fixed_plan"
            )
        if batch_size is not None:
            raise ValueError("batch_size: the planner's cost estimate, without effect under sharding.fixed_plan")
        missing = [n for n in names if n not in s.fixed_plan]
        unknown = sorted(set(s.fixed_plan) - set(names))
        if missing or unknown:
            raise ValueError(
                f"sharding.fixed_plan: must place exactly the model's tables {names} (missing {missing}, "
                f"unknown {unknown})"
            )
        for name, fp in s.fixed_plan.items():
            if device_type != "cuda" and fp.compute_kernel in CUDA_ONLY_KERNELS:
                raise ValueError(
                    f"sharding.fixed_plan.{name}.compute_kernel: {fp.compute_kernel} needs a CUDA device "
                    f"(this is {device_type}); use fused"
                )
        return 0
    unknown = [n for n in s.per_table if n not in names]
    if unknown:
        raise ValueError(f"sharding.per_table: unknown tables {sorted(unknown)}; the model's tables are {names}")
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


def id_limits(tables: list[EmbeddingBagConfig]) -> dict[str, tuple[int, str]]:
    """Feature name -> (rows of the smallest table it feeds, that table's name)."""
    out: dict[str, tuple[int, str]] = {}
    for t in tables:
        for f in t.feature_names:
            if f not in out or t.num_embeddings < out[f][0]:
                out[f] = (t.num_embeddings, t.name)
    return out


def check_kjt_ids(kjt, limits: dict[str, tuple[int, str]]) -> None:
    """Refuse a KeyedJaggedTensor holding an id outside ``[0, num_embeddings)`` of its table.

    One comparison over all values against each value's feature's limit, and one host sync.
    Features of no table are not checked.

    Raises:
        ValueError: names the feature, the first bad id, the table and its size.
    """
    keys = kjt.keys()
    if not keys or not any(k in limits for k in keys):
        return
    lengths = kjt.length_per_key()
    total = sum(lengths)
    values = kjt.values()[:total]
    if total == 0:
        return
    dev = values.device
    repeats = torch.tensor(lengths, device=dev)
    big = torch.iinfo(torch.int64).max
    per_key = torch.tensor([limits[k][0] if k in limits else big for k in keys], device=dev)
    bad = (values < 0) | (values >= torch.repeat_interleave(per_key, repeats, output_size=total))
    if not all(k in limits for k in keys):  # features of no table: not checked
        bad &= torch.repeat_interleave(
            torch.tensor([k in limits for k in keys], device=dev), repeats, output_size=total
        )
    if not bool(bad.any()):
        return
    i = int(torch.nonzero(bad)[0])
    k, start = 0, 0
    while start + lengths[k] <= i:
        start += lengths[k]
        k += 1
    rows, table = limits[keys[k]]
    raise ValueError(
        f"feature {keys[k]!r}: id {int(values[i])} is out of range for table {table!r} of {rows} rows "
        f"(ids must lie in [0, {rows - 1}]); {int(bad.sum())} id(s) of this batch are out of range"
    )


def _kjts(args: tuple, kwargs: dict) -> list:
    """The KeyedJaggedTensors among a call's arguments: the arguments themselves, and the
    ``sparse_features`` attribute of a batch object."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, KeyedJaggedTensor):
            found.append(a)
        elif isinstance(getattr(a, "sparse_features", None), KeyedJaggedTensor):
            found.append(a.sparse_features)
    return found


def ids_check_hook(tables: list[EmbeddingBagConfig]):
    """A forward pre-hook (``with_kwargs=True``) running :func:`check_kjt_ids` on every KJT
    passed to the module, directly or as a batch's ``sparse_features``."""
    limits = id_limits(tables)

    def hook(module, args, kwargs):
        for kjt in _kjts(args, kwargs):
            check_kjt_ids(kjt, limits)

    return hook


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

    Places the tables as ``sharding.fixed_plan`` says, or else plans with
    ``EmbeddingShardingPlanner`` on the process group (every sharding type is allowed on CPU
    too; rank 0 plans and broadcasts), then wraps the model in ``DistributedModelParallel``:
    tables are sharded, everything else is data-parallel (DDP). Build the model on ``meta``
    so no table memory is allocated before sharding, and call ``apply_optimizer_in_backward``
    on the tables first to choose their fused optimizer (default: SGD, lr 0.01). Every rank
    of ``pg`` must call this with the same arguments.

    Every key of ``sharding`` takes effect or is refused: ``sharding_types``,
    ``compute_kernels`` and ``per_table`` constrain the planner; ``storage_reservation``
    goes to it; ``hbm_gb`` (CUDA only), ``ddr_gb`` and the two bandwidths go to its
    topology (as in the trainer); ``cache_load_factor`` goes to tables that may use
    ``fused_uvm_caching``; ``planner_batch_size`` is the planner's batch size, like the
    ``batch_size`` argument. With ``fixed_plan`` no planner runs, so these keys and
    ``batch_size`` are refused there. ``comms`` (fp16 / bf16 output_dist) goes to the
    sharders in either case; bf16 is refused off CUDA. (``pooling`` is a property of each table: set it
    in the model's ``EmbeddingBagConfig``.)

    Args:
        model: e.g. a model with an ``EmbeddingBagCollection`` submodule. Table names must
            be unique across its collections.
        sharding: the ``sharding:`` config section (a ShardingConfig or a plain dict),
            e.g. ``{"sharding_types": ["row_wise"]}`` or ``{"fixed_plan": {"t_user":
            {"sharding_type": "table_wise", "ranks": [1]}, ...}}``. None = planner's choice.
        device: compute device (default: cuda:LOCAL_RANK when available, else cpu).
        batch_size: per-rank batch size the planner assumes for its cost estimates
            (default: ``sharding.planner_batch_size``, else 512; giving both, different, is
            an error).
        pg: process group (default: the world; it must already be initialised).
        seed: seed of the initial table weights (see ``init_tables``).
        init_tables: initialise every table as the trainer does
            (``recsys_dist.distributed.tables.init_tables``): uniform(-m, m) with m the table's
            ``weight_init_max`` (TorchRec's default sqrt(1 / num_embeddings) when unset), drawn
            per (seed, table index in module order, row chunk), so the weights are the same at
            every world size and sharding, and equal the trainer's for the same tables and
            seed. False keeps TorchRec's per-shard initialisation (which depends on the
            sharding), e.g. when you load your own weights next.
        check_ids: register a forward pre-hook on the returned DMP that refuses ids outside
            ``[0, num_embeddings)`` of their table (without it, FBGEMM's bounds check reads
            row 0 for such an id and only logs). It sees a KeyedJaggedTensor passed to the DMP directly
            (``dmp(kjt)``, ``dmp(dense, kjt)``, as keyword too) or as a batch's
            ``.sparse_features`` (``dmp(batch)``, as TrainPipelineSparseDist calls it; the
            pipeline traces ``dmp.module``, which the hook is not on). A KJT nested deeper, or
            ids your model changes (e.g. hashes) before its tables, are not seen: pass False
            then. Cost per call: one comparison over the ids and one host sync. Under
            TrainPipelineSparseDist the batch's input all-to-all has already started when the
            hook raises; the error is raised on the rank holding the bad id only, so treat it
            as fatal for the job.

    Returns:
        ``torchrec.distributed.DistributedModelParallel``; its ``.plan`` is the plan used.
        Calls take what the model takes, e.g. a KJT of B examples. Inside it, each
        EmbeddingBagCollection returns its pooled KeyedTensor, and each EmbeddingCollection its
        dict, in the unsharded module's key order (:mod:`recsys_dist.distributed.key_order`), so the model
        computes what it computes unsharded, also when it reads ``kt.values()`` by position.

    Raises:
        pydantic.ValidationError: a bad ``sharding`` section (a ValueError too).
        ValueError: before any collective, naming the key: ``per_table`` or ``fixed_plan``
            names a table the model lacks (the message lists the model's tables), a
            ``fixed_plan`` misses a table or uses a rank >= the world size, a key without
            effect (see above), a CUDA-only kernel or ``hbm_gb`` on another device, a model
            without EmbeddingBagCollection / EmbeddingCollection, one holding another embedding
            module (``nn.Embedding``, ``nn.EmbeddingBag``, ...: :func:`check_covered`), or with
            duplicate table names, an EmbeddingCollection table allowed no type its sharder offers, a table whose
            ``weight_init_min`` is not ``-weight_init_max`` or with its own ``init_fn`` while
            ``init_tables`` is on; after planning, column shards that are not multiples of 4
            wide. From the returned DMP's calls (``check_ids``): an id out of range, naming
            the feature, the id and the table's size.
    """
    from torchrec.distributed import DistributedModelParallel

    from recsys_dist.distributed import tables as state

    s = sharding if isinstance(sharding, ShardingConfig) else ShardingConfig.model_validate(sharding or {})
    if device is None:
        device = (
            torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    check_covered(model)
    tables = model_tables(model)
    if not tables:
        raise ValueError(
            f"{type(model).__name__} holds no EmbeddingBagCollection or EmbeddingCollection: nothing to shard"
        )
    names = [t.name for t in tables]
    planner_batch = check_shard_config(s, names, device.type, batch_size)
    if init_tables:
        _check_init_range(tables)
    pg = pg or dist.group.WORLD
    world = dist.get_world_size(pg)
    problems = comms_problems(s.comms, device.type, world)
    if problems:
        raise ValueError("; ".join(problems))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if s.fixed_plan is not None:
        plan = fixed_sharding_plan(model, s.fixed_plan, world, local, device.type)
    else:
        plan = planner(
            make_topology(s, world, local, device.type),
            planner_batch,
            table_constraints(s, names, unpooled=unpooled_names(tables)),
            s.storage_reservation,
        ).collective_plan(model, sharders(s.comms, device.type), pg)
    check_column_shards(plan)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders(s.comms, device.type))
    fix_replicated_sequence_tables(dmp)
    if init_tables:
        state.init_tables(dmp.state_dict(), tables, seed, {t.name: t.get_weight_init_max() for t in tables})
    if check_ids:
        dmp.register_forward_pre_hook(ids_check_hook(tables), with_kwargs=True)
    return dmp


def _check_init_range(tables: list[EmbeddingBagConfig]) -> None:
    import functools

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
