"""Sharders that offer every sharding type on CPU, and the checks of what they can shard.

TorchRec's ``EmbeddingBagCollectionSharder`` reports only data_parallel, table_wise,
column_wise and table_column_wise on CPU, although row_wise and table_row_wise train
correctly over gloo. :class:`EmbeddingBagCollectionSharderAllTypes` reports them all,
so the planner (and our tests) can use every type on CPU.

Unpooled (sequence) tables live in ``EmbeddingCollection`` modules and are sharded by
TorchRec's ``EmbeddingCollectionSharder``, which offers data_parallel, table_wise,
column_wise and row_wise (``config.SEQUENCE_SHARDING_TYPES``) on every device. Any other
embedding module (``nn.Embedding``, ``nn.EmbeddingBag``, a managed-collision collection) is
refused by :func:`check_covered` (before any rank starts: ``preflight.coverage_problems``; and at
plan time): DMP would otherwise replicate it silently.

Both sharders build the sharded collections of :mod:`recsys_dist.distributed.key_order`, whose outputs
keep the unsharded module's key order (TorchRec's come back ordered by sharding type and rank),
so a model reading ``kt.values()`` by position computes the same sharded and unsharded.
"""

from __future__ import annotations

import types

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbedding
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.types import ModuleSharder
from torchrec.distributed.types import ShardingType as TorchRecShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    EmbeddingCollection,
    EmbeddingCollectionInterface,
)

from recsys_dist.distributed.config import SHARDING_TYPES, CommsConfig
from recsys_dist.distributed.key_order import OrderedEmbeddingBagCollectionSharder, OrderedEmbeddingCollectionSharder
from recsys_dist.distributed.rules import comms_problems

# Our names are TorchRec's values (a renamed type fails here, at import).
ALL_TYPES = [TorchRecShardingType(t).value for t in SHARDING_TYPES]


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


def qcomm_codecs_registry(comms: CommsConfig | None, device_type: str):
    """TorchRec's qcomm codec registry for ``sharding.comms`` (None for fp32 both ways).

    Raises:
        ValueError: a precision the device's codecs cannot carry (see ``rules.comms_problems``).
    """
    if comms is None or (comms.forward, comms.backward) == ("fp32", "fp32"):
        return None
    problems = comms_problems(comms, device_type)
    if problems:
        raise ValueError("; ".join(problems))
    return get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType(comms.forward), backward_precision=CommType(comms.backward)),
        device=torch.device(device_type),
    )


def sharders(comms: CommsConfig | None = None, device_type: str = "cpu") -> list[ModuleSharder[nn.Module]]:
    """The sharders of every run: EmbeddingBagCollection (all six types) and EmbeddingCollection
    (``config.SEQUENCE_SHARDING_TYPES``), with quantized output_dist codecs when ``comms`` asks
    for them."""
    registry = qcomm_codecs_registry(comms, device_type)
    return [
        EmbeddingBagCollectionSharderAllTypes(qcomm_codecs_registry=registry),
        OrderedEmbeddingCollectionSharder(qcomm_codecs_registry=registry),
    ]


def model_tables(model: nn.Module) -> list[BaseEmbeddingConfig]:
    """The tables of every EmbeddingBagCollection (``EmbeddingBagConfig``) and
    EmbeddingCollection (``EmbeddingConfig``) in ``model``, in module order.

    Raises:
        ValueError: two collections hold tables of the same name (names key the plan).
    """
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


def unpooled_names(tables: list[BaseEmbeddingConfig]) -> set[str]:
    """Names of the EmbeddingCollection (unpooled, ``EmbeddingConfig``) tables among ``tables``."""
    return {t.name for t in tables if isinstance(t, EmbeddingConfig)}
