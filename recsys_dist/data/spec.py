"""FeatureSpec: what the data preparation decided about features and tables, given to models.

A model factory is called as ``factory(spec, **model.args)`` (docs/api.md); the shipped
models are built from the same object. The spec is made after the data is converted, so
``tables`` carry the table sizes the data needs (under ``categorical_mapping: vocabulary``
the vocabularies' sizes), and the run config is never changed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, PoolingType

from recsys_dist.data.mapping import MANAGED_ID_SPACE

# FBGEMM's fused kernel needs widths that are multiples of 4, so a per-id scalar weight
# (first-order / wide part) is stored as 4 columns that the model averages.
FIRST_ORDER_DIM = 4


@dataclass(frozen=True)
class FeatureSpec:
    """Features and tables of a run, as a model factory receives them.

    Attributes:
        dense_names: dense feature names; ``dense`` is float32 ``[B, len(dense_names)]`` in
            this order.
        sparse_names: categorical feature names, the keys of the ``sparse``
            KeyedJaggedTensor (int64 ids, one bag per example; one-hot or multi-hot).
        tables: one ``torchrec.EmbeddingBagConfig`` per sparse feature, in ``sparse_names``
            order, named ``t_<feature>``: ``num_embeddings`` as the data preparation decided
            (ids lie in ``[0, num_embeddings)``, 0 = missing), ``embedding_dim`` from
            ``model.embedding_dim``, pooling from ``data.pooling`` / ``data.feature_pooling``,
            ``weight_init_min/max`` from ``model.embedding_init_scale``.
        embedding_device: build EmbeddingBagCollections here: ``meta`` while planning (the
            sharder materialises each rank's shards), ``cpu`` for an unsharded model.
        device: where dense parameters go (the rank's compute device).
        tasks: label names; a model returns one logit per task (``[B]`` / ``[B, 1]`` for one).
        first_order_tables: width-4 tables ``w_<feature>`` for models registered with
            ``first_order_tables=True`` (DeepFM family); empty otherwise.
        sequence_names: sequence (unpooled) feature names, also keys of the ``sparse``
            KeyedJaggedTensor: per example an ordered list of ids, oldest first, at most the
            column's ``max_length`` (``data.schema.sequence``); may be empty. Empty when the
            data has no sequence feature, so a model that ignores them works as before.
        sequence_tables: one ``torchrec.EmbeddingConfig`` per sequence feature, in
            ``sequence_names`` order, named ``s_<feature>``, width ``model.embedding_dim``;
            build them into a ``torchrec.EmbeddingCollection``, whose output is one
            ``JaggedTensor`` per feature (``[sum of lengths, E]`` values, one row per position).
            The sharders shard them data_parallel, table_wise, row_wise or column_wise.
        id_counts: ``{feature: int64 [num_embeddings]}``, rows of the training split holding
            each id of that feature; set by the Trainer for retrieval models (the item feature:
            the logQ correction's sampling probabilities, ``recsys_dist.models.retrieval``), empty
            otherwise and for models built outside training (export, scoring).
        task_kinds: one per task, ``binary`` / ``regression``.
        label_columns: the converted Parquet's label columns, one per task (``["label"]``, or
            ``["label:<task>", ...]``); ``weight_column``: its sample-weight column, or None.
        value_names: raw-valued sequence features, the last keys of the ``sparse``
            KeyedJaggedTensor, with no table: per example a list of int64 values ``1 + v``
            (``v >= 0``; 0 never occurs), as long as the sequence it describes
            (``data.schema.history.times``: ``<history>_time``, per event the time before the row).
        sequence_lengths: ``{feature: the most events a row holds}`` for the sequence and
            raw-valued features whose length the data bounds (``data.schema.sequence``'s
            ``max_length``; ``data.schema.history.max_length`` for the history and the features
            it derives); empty where unknown (a hand-made spec). Read by models that pad to a
            fixed length (``hstu`` under ``distributed.dense.strategy: pipeline``).
        managed: the features whose ids a managed-collision module maps
            (``data.categorical_mapping: managed``: all; else ``data.managed.features``); their
            ids lie in ``[0, 2**63 - 1)`` until the module remaps them to table rows.
    """

    dense_names: list[str]
    sparse_names: list[str]
    tables: list[EmbeddingBagConfig]
    embedding_device: torch.device = field(default_factory=lambda: torch.device("meta"))
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tasks: list[str] = field(default_factory=lambda: ["label"])
    first_order_tables: list[EmbeddingBagConfig] = field(default_factory=list)
    sequence_names: list[str] = field(default_factory=list)
    sequence_tables: list[EmbeddingConfig] = field(default_factory=list)
    id_counts: dict = field(default_factory=dict)
    task_kinds: list[str] = field(default_factory=lambda: ["binary"])
    label_columns: list[str] = field(default_factory=lambda: ["label"])
    weight_column: str | None = None
    managed: list[str] = field(default_factory=list)
    value_names: list[str] = field(default_factory=list)
    sequence_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def num_dense(self) -> int:
        """Dense features per example (the width of ``dense``)."""
        return len(self.dense_names)

    @property
    def num_embeddings(self) -> list[int]:
        """Rows of each ``t_<feature>`` table, in ``sparse_names`` order."""
        return [t.num_embeddings for t in self.tables]

    @property
    def embedding_dim(self) -> int:
        """Width of the ``t_<feature>`` tables (``model.embedding_dim``)."""
        return self.tables[0].embedding_dim

    @property
    def keys(self) -> list[str]:
        """Every key of the ``sparse`` KeyedJaggedTensor: ``sparse_names``, ``sequence_names``, then
        ``value_names``."""
        return [*self.sparse_names, *self.sequence_names, *self.value_names]

    @property
    def id_bounds(self) -> list[int]:
        """Per key of :attr:`keys`, the bound a loader checks ids against: the table's rows, or
        for a managed feature the raw id space ``2**63 - 1`` (its module maps ids to rows)."""
        rows = [t.num_embeddings for t in [*self.tables, *self.sequence_tables]] + [0] * len(self.value_names)
        raw = {*self.managed, *self.value_names}
        return [MANAGED_ID_SPACE if k in raw else n for k, n in zip(self.keys, rows)]

    def all_tables(self) -> list[EmbeddingBagConfig]:
        """Every pooled table: ``tables`` then ``first_order_tables`` (one EmbeddingBagCollection
        takes them all). ``sequence_tables`` are not among them: they need an EmbeddingCollection."""
        return [*self.tables, *self.first_order_tables]

    def planned_tables(self) -> list[BaseEmbeddingConfig]:
        """Every table of the run: :meth:`all_tables`, then ``sequence_tables``."""
        return [*self.all_tables(), *self.sequence_tables]

    def on(self, embedding_device: torch.device, device: torch.device | None = None) -> FeatureSpec:
        """The same spec with other devices (e.g. ``cpu`` tables for an unsharded model)."""
        return dataclasses.replace(self, embedding_device=embedding_device, device=device or self.device)


def make_sequence_tables(
    names: list[str], num_embeddings: list[int], embedding_dim: int, *, init_scale: float | None = 0.05
) -> list[EmbeddingConfig]:
    """One ``EmbeddingConfig`` (unpooled) per sequence feature, ``s_<feature>``, initialised
    like :func:`make_tables`.

    Raises:
        ValueError: the sizes do not match the features.
    """
    if len(num_embeddings) != len(names):
        raise ValueError(f"{len(num_embeddings)} table sizes for {len(names)} sequence features")
    out = []
    for name, rows in zip(names, num_embeddings):
        s = init_scale if init_scale is not None else math.sqrt(1.0 / rows)
        out.append(
            EmbeddingConfig(
                name=f"s_{name}",
                embedding_dim=embedding_dim,
                num_embeddings=rows,
                feature_names=[name],
                weight_init_min=-s,
                weight_init_max=s,
            )
        )
    return out


def make_tables(
    sparse_names: list[str],
    num_embeddings: list[int],
    embedding_dim: int,
    *,
    prefix: str = "t_",
    init_scale: float | None = 0.05,
    pooling: dict[str, str] | None = None,
    default_pooling: str = "sum",
) -> list[EmbeddingBagConfig]:
    """One ``EmbeddingBagConfig`` per feature, ``<prefix><feature>``, initialised uniform in
    ``[-init_scale, init_scale]`` (None: TorchRec's ``sqrt(1 / num_embeddings)``).

    Raises:
        ValueError: the sizes do not match the features.
    """
    if len(num_embeddings) != len(sparse_names):
        raise ValueError(f"{len(num_embeddings)} table sizes for {len(sparse_names)} features")
    out = []
    for name, rows in zip(sparse_names, num_embeddings):
        s = init_scale if init_scale is not None else math.sqrt(1.0 / rows)
        mode = (pooling or {}).get(name, default_pooling)
        out.append(
            EmbeddingBagConfig(
                name=f"{prefix}{name}",
                embedding_dim=embedding_dim,
                num_embeddings=rows,
                feature_names=[name],
                pooling=PoolingType.MEAN if mode == "mean" else PoolingType.SUM,
                weight_init_min=-s,
                weight_init_max=s,
            )
        )
    return out
