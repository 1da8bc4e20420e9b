"""Build the configured model: a FeatureSpec from the data's format and sections, the registered
model over it, the loss."""

from __future__ import annotations

from collections.abc import Callable
from numbers import Integral

import torch

from recsys_dist.data.config import DataConfig
from recsys_dist.data.formats.base import RawFormat
from recsys_dist.data.resolve import configured_sizes, managed_names
from recsys_dist.data.spec import FeatureSpec, make_sequence_tables, make_tables
from recsys_dist.models.config import ModelConfig
from recsys_dist.models.losses import get_loss
from recsys_dist.models.registry import get_model
from recsys_dist.models.task import CTRTask
from recsys_dist.train.config import TrainConfig


def feature_spec(
    fmt: RawFormat,
    data: DataConfig,
    model: ModelConfig,
    num_embeddings: list[int] | None = None,
    device: torch.device | None = None,
    embedding_device: torch.device | None = None,
    on_features: Callable[[FeatureSpec], FeatureSpec] | None = None,
) -> FeatureSpec:
    """The :class:`FeatureSpec` of a run: format ``fmt``'s features, ``num_embeddings`` rows per
    table (in ``fmt.sparse_names`` order; default: as configured, ``data.num_embeddings``),
    ``model.embedding_dim`` / ``embedding_init_scale``, ``data.pooling`` / ``data.feature_pooling``,
    the tasks, label columns and managed features; then ``on_features`` (the registered model's
    hook: DeepFM's first-order tables).

    Sequence features (``data.schema.sequence`` / ``history``) get ``s_<feature>`` EmbeddingConfigs
    in ``sequence_tables`` and are not among ``sparse_names``.

    Raises:
        ValueError: the sizes do not match the features (one int >= 2 per feature).
    """
    keys = list(fmt.sparse_names)
    all_sizes = _sizes(keys, num_embeddings) if num_embeddings is not None else configured_sizes(data, fmt)
    seq, values = list(fmt.sequence_names), list(getattr(fmt, "value_names", []))
    sparse = [k for k in keys if k not in seq and k not in values]
    sizes = [n for k, n in zip(keys, all_sizes) if k not in seq and k not in values]
    seq_sizes = [n for k, n in zip(keys, all_sizes) if k in seq]
    pooling = dict(default_pooling=data.pooling, pooling=data.feature_pooling, init_scale=model.embedding_init_scale)
    spec = FeatureSpec(
        dense_names=list(fmt.dense_names),
        sparse_names=sparse,
        tables=make_tables(sparse, sizes, model.embedding_dim, **pooling),
        embedding_device=embedding_device or torch.device("meta"),
        device=device or torch.device("cpu"),
        tasks=list(fmt.task_names),
        sequence_names=seq,
        sequence_tables=make_sequence_tables(
            seq, seq_sizes, model.embedding_dim, init_scale=model.embedding_init_scale
        ),
        task_kinds=list(fmt.task_kinds),
        label_columns=list(fmt.label_columns),
        weight_column=fmt.weight_column,
        managed=managed_names(data, fmt),
        value_names=values,
        sequence_lengths=_sequence_lengths(data, [*seq, *values]),
    )
    return on_features(spec) if on_features is not None else spec


def _sequence_lengths(data: DataConfig, names: list[str]) -> dict[str, int]:
    """``FeatureSpec.sequence_lengths``: each of ``names`` whose ``max_length`` the schema gives
    (a ``data.schema.sequence`` column's, or the history's for the history and what it derives:
    ``<history>_action``, ``<history>_time``)."""
    schema = getattr(data, "schema", None)
    if schema is None:
        return {}
    lengths = {n: s.max_length for n, s in schema.sequence.items()}
    h = schema.history
    if h is not None:
        lengths.update({n: h.max_length for n in (h.name, f"{h.name}_action", f"{h.name}_time")})
    return {n: lengths[n] for n in names if n in lengths}


def _sizes(keys: list[str], num_embeddings) -> list[int]:
    # Given sizes (the public feature_spec / resolve_job's, a preprocessing record's): a wrong
    # count would be cut to the shorter by zip, a 0 or a float fail deep in torch.
    if isinstance(num_embeddings, (str, bytes)) or not hasattr(num_embeddings, "__len__"):
        raise ValueError(f"num_embeddings: expected a list of {len(keys)} table sizes, got {num_embeddings!r}")
    sizes = list(num_embeddings)
    if len(sizes) != len(keys):
        raise ValueError(
            f"num_embeddings: {len(sizes)} table sizes for {len(keys)} categorical features "
            f"({', '.join(keys)}): give one per feature, in this order"
        )
    bad = [f"{k}: {n!r}" for k, n in zip(keys, sizes) if isinstance(n, bool) or not isinstance(n, Integral) or n < 2]
    if bad:
        raise ValueError(
            f"num_embeddings: table sizes must be ints >= 2 (row 0 is reserved for missing values), got {', '.join(bad)}"
        )
    return [int(n) for n in sizes]  # numpy ints (a conversion's sizes) as Python ints


def build_model(
    model_cfg: ModelConfig,
    features: FeatureSpec,
    train_cfg: TrainConfig | None = None,
    *,
    remap: torch.nn.Module | None = None,
    loss=None,
    module: torch.nn.Module | Callable[[FeatureSpec], torch.nn.Module] | None = None,
) -> CTRTask:
    """The model ``model_cfg.name`` names, built over ``features``, wrapped with the training loss.

    Args:
        model_cfg: the ``model`` section (an instance of the registered model's config class).
        features: the run's :class:`FeatureSpec` (tables on ``features.embedding_device``, dense
            parameters on ``features.device``); tasks and their kinds come from it.
        train_cfg: the ``train`` section (``loss`` / ``loss_args`` / ``task_loss`` /
            ``precision``); default: ``TrainConfig()`` (binary cross-entropy, fp32).
        remap: the managed-collision remap of ``features.managed``
            (``recsys_dist.models.managed.build_remap``); needed when that list is not empty.
        loss: a loss function overriding ``train.loss`` (same signature, docs/api.md).
        module: the model itself, or a factory ``features -> nn.Module``, instead of the one
            ``model_cfg.name`` names (``Trainer(model=...)``).

    Returns:
        :class:`CTRTask`: ``forward(batch) -> (loss, (loss, logits, labels, weights))``.

    Raises:
        TypeError: an argument of another type (e.g. the root config for a section).
        ValueError: the model is not an ``nn.Module``; managed features without a ``remap``.
    """
    for arg, value, cls in (("model_cfg", model_cfg, ModelConfig), ("features", features, FeatureSpec)):
        if not isinstance(value, cls):
            raise TypeError(
                f"build_model: {arg} must be a {cls.__name__}, got {type(value).__name__}; call "
                "build_model(job.model, job.features.on(device), job.train) with job = recsys_dist.resolve_job(cfg)"
            )
    if train_cfg is not None and not isinstance(train_cfg, TrainConfig):
        raise TypeError(f"build_model: train_cfg must be the train section (job.train), got {type(train_cfg).__name__}")
    if module is None:
        model = get_model(model_cfg.name).build(features, model_cfg)
        source = f"model.name: {model_cfg.name}"
    else:
        model = module if isinstance(module, torch.nn.Module) else module(features)
        source = f"the model factory {getattr(module, '__qualname__', module)!r}"
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{source} returned {type(model).__name__}, not a torch.nn.Module")
    if features.managed and remap is None:
        raise ValueError(f"features {features.managed} have managed-collision tables: pass their remap")
    t = train_cfg if train_cfg is not None else TrainConfig()
    bf16 = features.device.type if t.precision == "bf16-mixed" else None
    names, kinds = list(features.tasks), list(features.task_kinds)
    if names != ["label"]:  # data.schema.labels: a loss (and weight) per task
        per_task = [
            (n, loss or get_loss(name), args if loss is None else {}, w)
            for n, (name, args, w) in zip(names, t.task_losses(names, kinds))
        ]
        return CTRTask(model, bf16, tasks=per_task, remap=remap)
    return CTRTask(model, bf16, loss or get_loss(t.loss), dict(t.loss_args) if loss is None else {}, remap=remap)
