"""Sharded embedding collections whose outputs keep the unsharded module's key order.

TorchRec's ``ShardedEmbeddingBagCollection`` concatenates its pooled ``KeyedTensor`` one
sharding after another (grouped by sharding type, then by rank): table-wise on 2 ranks, an
unsharded ``user, item, tags`` comes back as ``user, tags, item``, and mixed sharding types
reorder it too. ``ShardedEmbeddingCollection`` builds its ``Dict[str, JaggedTensor]`` in the
same per-sharding order. Keys travel with their columns, so ``kt["user"]`` and
``kt.to_dict()`` are right either way, but a model that reads ``kt.values()`` (or the dict's
values) by position would train on one column order and be exported, evaluated and served
(unsharded) with another: a different model, with no error. The sharded modules here put
their output back in the unsharded module's key order: one ``index_select`` over the pooled
columns ``[B, sum of dims]`` (a copy; nothing when the orders already agree), and a reordered
dict for sequences (no copy). TorchRec 1.8 has no option for this (its
``sharded_module_order_overwrite`` orders sharding types, not tables).

The pooled collection also replaces TorchRec's divisor for mean-pooled row-wise tables, which
divided the bags of every other sharding type too (see
:class:`OrderedShardedEmbeddingBagCollection`).
"""

from __future__ import annotations

from functools import partial

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor


def _check_same_keys(module: str, sharded: list[str], unsharded: list[str]) -> None:
    if sorted(sharded) != sorted(unsharded):
        raise RuntimeError(
            f"sharded {module} returns keys {sharded}, the unsharded one {unsharded}: cannot put the sharded "
            "output in the unsharded order (a TorchRec version recsys_dist does not know?)"
        )


def _permute_pooled(kt: KeyedTensor, keys: list[str], dims: list[int], columns: torch.Tensor) -> KeyedTensor:
    """``kt`` [B, sum of dims] with its columns taken in the order ``columns`` (keys ``keys``)."""
    values = kt.values()
    return KeyedTensor(
        keys=keys, length_per_key=dims, values=values.index_select(1, columns.to(values.device)), key_dim=1
    )


class OrderedShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """A ``ShardedEmbeddingBagCollection`` whose pooled ``KeyedTensor`` has the unsharded
    module's keys in the unsharded order: ``keys()``, ``length_per_key()`` and the columns of
    ``values()`` (float32 ``[B, sum of dims]``) are those of ``EmbeddingBagCollection.forward``
    on the same ids and weights, whatever the sharding plan.

    Also corrects TorchRec 1.8's mean pooling of row-wise tables. Such a table is looked up
    with sum pooling on each rank and the partial sums reduce-scattered; when one is
    mean-pooled, TorchRec divides the whole pooled output by a per-feature divisor that is 1
    only for row-wise sum features: the bags of every other sharding type (table_wise,
    column_wise, data_parallel), which their kernels had already pooled, were divided by their
    length too (a sum bag of 3 ids came back as a third of its sum, a mean bag divided twice;
    0.29 off for one table of a planner's row_wise + data_parallel plan), silently. Here the
    divisor is per embedding (:func:`_mean_divisor`): the id count for a mean-pooled row-wise
    table's bags, 1 for every other column, also when one feature feeds both kinds of table.
    (Variable-batch KJTs, which recsys_dist does not make, keep TorchRec's divisor.)

    Raises:
        RuntimeError: at construction, when the sharded and unsharded keys differ as sets.
    """

    def __init__(self, module, table_name_to_parameter_sharding, *args, **kwargs) -> None:
        super().__init__(module, table_name_to_parameter_sharding, *args, **kwargs)
        configs = module.embedding_bag_configs()
        self._unsharded_keys = [n for names in get_embedding_names_by_table(configs) for n in names]
        self._unsharded_dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        self._column_order: tuple[tuple[str, ...], torch.Tensor | None] | None = None
        types = {c.name: table_name_to_parameter_sharding[c.name].sharding_type for c in configs}
        self._row_wise_mean = _row_wise_mean(configs, types) if self._has_mean_pooling_callback else None
        self._mean_plan: tuple[tuple[str, ...], list[str], list[bool], torch.Tensor] | None = None

    def _columns(self) -> torch.Tensor | None:
        """Column index taking the sharded output to the unsharded order (None: already in it).
        Recomputed when the sharded order changes (``update_shards``)."""
        names = tuple(self._embedding_names)
        if self._column_order is None or self._column_order[0] != names:
            _check_same_keys("EmbeddingBagCollection", list(names), self._unsharded_keys)
            starts, at = {}, 0
            for name, dim in zip(names, self._embedding_dims):
                starts[name] = (at, dim)
                at += dim
            columns = [c for k in self._unsharded_keys for c in range(starts[k][0], starts[k][0] + starts[k][1])]
            index = None if columns == list(range(at)) else torch.tensor(columns, device=self._device)
            self._column_order = (names, index)
        return self._column_order[1]

    def input_dist(self, ctx, features):
        # Our divisor replaces TorchRec's (made in super().input_dist) for a fixed-batch KJT;
        # computed first: a pipeline may free the KJT's storage inside input_dist.
        divisor = None
        if self._row_wise_mean is not None and isinstance(features, KeyedJaggedTensor):
            if not features.variable_stride_per_key():
                divisor = self._divisor(features)
        awaitable = super().input_dist(ctx, features)
        if divisor is not None:
            ctx.divisor = divisor
        return awaitable

    def _divisor(self, features: KeyedJaggedTensor) -> torch.Tensor:
        names = tuple(self._embedding_names)
        if self._mean_plan is None or self._mean_plan[0] != names:
            info = [self._row_wise_mean[n] for n in names]
            dims = torch.tensor(self._embedding_dims, device=self._device)
            self._mean_plan = (names, [f for f, _ in info], [m for _, m in info], dims)
        return _mean_divisor(features, *self._mean_plan[1:])

    def _in_unsharded_order(self, awaitable):
        # After TorchRec's own callbacks (mean pooling), which expect the sharded order.
        columns = self._columns()
        if columns is not None:
            awaitable.callbacks.append(
                partial(_permute_pooled, keys=self._unsharded_keys, dims=self._unsharded_dims, columns=columns)
            )
        return awaitable

    def output_dist(self, ctx, output):
        return self._in_unsharded_order(super().output_dist(ctx, output))

    def compute_and_output_dist(self, ctx, input):
        return self._in_unsharded_order(super().compute_and_output_dist(ctx, input))


def _row_wise_mean(configs, types: dict[str, str]) -> dict[str, tuple[str, bool]]:
    """Embedding name -> (its feature, whether it is a mean-pooled row-wise table's)."""
    row_wise = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
    out = {}
    for c, names in zip(configs, get_embedding_names_by_table(configs)):
        mean = c.pooling == PoolingType.MEAN and types[c.name] in row_wise
        out.update({name: (feature, mean) for feature, name in zip(c.feature_names, names)})
    return out


def _mean_divisor(
    features: KeyedJaggedTensor, feature_of: list[str], mean: list[bool], dims: torch.Tensor
) -> torch.Tensor:
    """[B, sum of dims], float32: per column, the bag's id count (its weight sum for a weighted
    KJT; 1 for an empty bag) for a mean-pooled row-wise table's embedding, 1 elsewhere; the
    columns in the sharded output's order (``feature_of``, ``mean``, ``dims`` per embedding)."""
    keys, batch = features.keys(), features.stride()
    weights = features.weights_or_none()
    lengths = (
        features.lengths()
        if weights is None
        else torch.ops.fbgemm.segment_sum_csr(1, features.offsets().int(), weights)
    )
    per_key = lengths.view(len(keys), batch).float()
    per_key = torch.where(per_key == 0, torch.ones_like(per_key), per_key)
    index = {k: i for i, k in enumerate(keys)}
    ones = torch.ones(batch, device=per_key.device)
    per_embedding = torch.stack([per_key[index[f]] if m else ones for f, m in zip(feature_of, mean)], dim=1)
    return torch.repeat_interleave(per_embedding, dims.to(per_key.device), dim=1, output_size=int(dims.sum()))


def _reorder_dict(d: dict, keys: list[str]) -> dict:
    return {k: d[k] for k in keys}


class OrderedShardedEmbeddingCollection(ShardedEmbeddingCollection):
    """A ``ShardedEmbeddingCollection`` whose ``Dict[str, JaggedTensor]`` lists its keys in the
    unsharded ``EmbeddingCollection``'s order (table by table, feature by feature).

    Raises:
        RuntimeError: at construction, when the sharded and unsharded keys differ as sets.
    """

    def __init__(self, module, *args, **kwargs) -> None:
        super().__init__(module, *args, **kwargs)
        self._unsharded_keys = [n for names in module.embedding_names_by_table() for n in names]

    def _in_unsharded_order(self, awaitable):
        sharded = [n for names in self._embedding_names_per_sharding for n in names]
        if sharded != self._unsharded_keys:
            _check_same_keys("EmbeddingCollection", sharded, self._unsharded_keys)
            awaitable.callbacks.append(partial(_reorder_dict, keys=self._unsharded_keys))
        return awaitable

    def output_dist(self, ctx, output):
        return self._in_unsharded_order(super().output_dist(ctx, output))

    def compute_and_output_dist(self, ctx, input):
        return self._in_unsharded_order(super().compute_and_output_dist(ctx, input))


class OrderedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EmbeddingBagCollection sharder, building :class:`OrderedShardedEmbeddingBagCollection`."""

    def shard(self, module, params, env, device=None, module_fqn=None) -> OrderedShardedEmbeddingBagCollection:
        return OrderedShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )

    @property
    def sharded_module_type(self):
        return OrderedShardedEmbeddingBagCollection


class OrderedEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """TorchRec's EmbeddingCollection sharder, building :class:`OrderedShardedEmbeddingCollection`."""

    def shard(self, module, params, env, device=None, module_fqn=None) -> OrderedShardedEmbeddingCollection:
        return OrderedShardedEmbeddingCollection(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
            module_fqn=module_fqn,
        )

    @property
    def sharded_module_type(self):
        return OrderedShardedEmbeddingCollection
