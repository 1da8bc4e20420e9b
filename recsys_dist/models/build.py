"""Build the configured model: a FeatureSpec from the data, the registered model over it, the loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recsys_dist.data.resolve import feature_names, managed_features, sequence_names, tasks
from recsys_dist.data.spec import FeatureSpec, make_sequence_tables, make_tables
from recsys_dist.models.losses import get_loss
from recsys_dist.models.managed import build_remap
from recsys_dist.models.registry import get_model
from recsys_dist.models.task import CTRTask


def table_sizes(cfg) -> list[int]:
    """Rows per ``t_<feature>`` table as configured (``data.num_embeddings``). Under vocabulary
    mapping the data preparation decides the real sizes (``PreparedData.num_embeddings``)."""
    d = getattr(cfg, "data", cfg)
    n = d.num_embeddings
    return list(n) if isinstance(n, list) else [n] * len(feature_names(d)[1])


def feature_spec(
    cfg,
    num_embeddings: list[int] | None = None,
    device: torch.device | None = None,
    embedding_device: torch.device | None = None,
    given_model: bool = False,
) -> FeatureSpec:
    """The :class:`FeatureSpec` of a run config (``RunConfig``; not imported here: config.run
    imports preflight, which builds models): its format's features, ``num_embeddings`` rows
    per table (default: as configured), ``model.embedding_dim`` / ``embedding_init_scale``,
    ``data.pooling`` / ``data.feature_pooling``; then the model's ``on_features`` hook (DeepFM's
    first-order tables), unless ``given_model`` (``Trainer(model=...)``: ``model.name`` names
    no model of the run).
    Sequence features (``data.schema.sequence`` / ``history``) get ``s_<feature>`` EmbeddingConfigs
    in ``sequence_tables`` and are not among ``sparse_names``."""
    dense, keys = feature_names(cfg)
    all_sizes = list(num_embeddings) if num_embeddings is not None else table_sizes(cfg)
    seq = sequence_names(cfg)
    sparse = [k for k in keys if k not in seq]
    sizes = [n for k, n in zip(keys, all_sizes) if k not in seq]
    seq_sizes = [n for k, n in zip(keys, all_sizes) if k in seq]
    m, d = cfg.model, cfg.data
    pooling = dict(default_pooling=d.pooling, pooling=d.feature_pooling, init_scale=m.embedding_init_scale)
    spec = FeatureSpec(
        dense_names=dense,
        sparse_names=sparse,
        tables=make_tables(sparse, sizes, m.embedding_dim, **pooling),
        embedding_device=embedding_device or torch.device("meta"),
        device=device or torch.device("cpu"),
        tasks=tasks(cfg)[0],
        sequence_names=seq,
        sequence_tables=make_sequence_tables(seq, seq_sizes, m.embedding_dim, init_scale=m.embedding_init_scale),
    )
    add_tables = None if given_model else get_model(m.name).on_features  # DeepFM's first-order tables
    return add_tables(spec) if add_tables is not None else spec


def embedding_configs(cfg, num_embeddings: list[int] | None = None) -> list[EmbeddingBagConfig]:
    """Every table of the configured model (``t_<feature>``, ``w_<feature>`` first-order, then
    ``s_<feature>`` sequence tables)."""
    return feature_spec(cfg, num_embeddings).planned_tables()


def build_model(
    cfg,
    spec: FeatureSpec | torch.device,
    tables_device: torch.device | None = None,
    loss=None,
    module: torch.nn.Module | Callable[[FeatureSpec], torch.nn.Module] | None = None,
) -> CTRTask:
    """The model ``model.name`` names, built over ``spec``, wrapped with the training loss.

    Args:
        cfg: the run config (``model``, ``train.loss`` / ``loss_args`` / ``precision``).
        spec: the run's :class:`FeatureSpec`; or a device, for a spec made from the config
            alone (configured table sizes; tables on ``tables_device``, default ``meta``).
        loss: a loss function overriding ``train.loss`` (same signature, docs/api.md).
        module: the model itself, or a factory ``spec -> nn.Module``, instead of the one
            ``model.name`` names (``Trainer(model=...)``).

    Returns:
        :class:`CTRTask`: ``forward(batch) -> (loss, (loss, logits, labels, weights))``.

    Raises:
        ValueError: the model is not an ``nn.Module``.
    """
    if isinstance(spec, torch.device):
        spec = feature_spec(cfg, device=spec, embedding_device=tables_device)
    if module is None:
        model = get_model(cfg.model.name).build(spec, cfg.model)
        source = f"model.name: {cfg.model.name}"
    else:
        model = module if isinstance(module, torch.nn.Module) else module(spec)
        source = f"the model factory {getattr(module, '__qualname__', module)!r}"
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{source} returned {type(model).__name__}, not a torch.nn.Module")
    t = cfg.train
    bf16 = spec.device.type if t.precision == "bf16-mixed" else None
    remap = None
    if managed_features(cfg):
        remap = build_remap(cfg, spec.sparse_names, spec.num_embeddings, spec.device)
    names, kinds = tasks(cfg)
    if names != ["label"]:  # data.schema.labels: a loss (and weight) per task
        per_task = [
            (n, loss or get_loss(name), args if loss is None else {}, w)
            for n, (name, args, w) in zip(names, t.task_losses(names, kinds))
        ]
        return CTRTask(model, bf16, tasks=per_task, remap=remap)
    return CTRTask(model, bf16, loss or get_loss(t.loss), dict(t.loss_args) if loss is None else {}, remap=remap)
