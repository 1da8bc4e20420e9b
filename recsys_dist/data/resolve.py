"""A ``data`` section resolved: its format object (:func:`raw_format`, a lookup in the format
registry ``formats.base.FORMATS``), the feature names, tasks and label columns the format gives,
and its conversion (:func:`prepare_from_config`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

# The format modules register themselves in FORMATS when imported.
import recsys_dist.data.formats.avazu  # noqa: F401
import recsys_dist.data.formats.criteo  # noqa: F401
import recsys_dist.data.formats.schema  # noqa: F401
from recsys_dist.data.convert import prepare
from recsys_dist.data.convert.manifest import PreparedData
from recsys_dist.data.formats.base import FORMATS, RawFormat

if TYPE_CHECKING:  # annotations only: DataConfig's validator calls raw_format, run imports data.config (cycles)
    from recsys_dist.config.run import RunConfig
    from recsys_dist.data.config import DataConfig


def raw_format(name: str, schema=None, short_lines: str = "error") -> RawFormat:
    """The format object for ``data.format`` (``criteo_tsv``, ``avazu_csv``, or ``schema`` with
    its ``data.schema`` section); ``short_lines``: ``data.short_lines`` (criteo_tsv only).

    Raises:
        ValueError: an unknown format name.
    """
    if name not in FORMATS:
        raise ValueError(f"data.format: unknown format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name](schema, short_lines)


def _format_of(d):
    """The format object of a ``data`` section."""
    return raw_format(d.format, d.schema, getattr(d, "short_lines", "error"))


def feature_names(cfg) -> tuple[list[str], list[str]]:
    """(dense, categorical) feature names of a ``data`` section's format (or a run config's), in
    model order: the keys of the loader's KeyedJaggedTensor, sequence features (:func:`sequence_names`) last."""
    d = getattr(cfg, "data", cfg)
    fmt = raw_format(d.format, d.schema)
    return list(fmt.dense_names), list(fmt.sparse_names)


def sequence_names(cfg) -> list[str]:
    """The sequence (unpooled) features among ``feature_names(cfg)[1]``: ``data.schema.sequence``
    columns, then ``data.schema.history.name``; empty for formats without them."""
    d = getattr(cfg, "data", cfg)
    return list(raw_format(d.format, d.schema).sequence_names)


def tasks(cfg) -> tuple[list[str], list[str]]:
    """(task names, kinds ``binary`` / ``regression``) of a ``data`` section (or a run config's), in
    the order of the label columns: ``(["label"], ["binary"])`` unless ``data.schema.labels`` is set."""
    d = getattr(cfg, "data", cfg)
    fmt = raw_format(d.format, d.schema)
    return list(fmt.task_names), list(fmt.task_kinds)


def label_columns(cfg) -> tuple[list[str], str | None]:
    """(label columns, sample-weight column or None) of the converted Parquet, as the loader reads
    them: ``["label"]`` for one task, ``["label:<task>", ...]`` for ``data.schema.labels``."""
    d = getattr(cfg, "data", cfg)
    fmt = raw_format(d.format, d.schema)
    return list(fmt.label_columns), fmt.weight_column


def prepare_from_config(cfg: RunConfig | DataConfig, progress: bool = False) -> PreparedData:
    """Convert (or reuse) the Parquet splits described by a ``data`` section (or a run config's).

    Returns ``PreparedData``; its ``num_embeddings`` are the table sizes to train with
    (from the vocabulary under ``data.categorical_mapping: vocabulary``).
    """
    d = getattr(cfg, "data", cfg)
    return prepare(
        _format_of(d),
        d.raw_path,
        d.num_embeddings,
        d.split,
        d.num_rows,
        d.cache_dir,
        on_bad_row=d.on_bad_row,
        progress=progress,
        mapping=d.categorical_mapping,
        min_count=d.min_count,
        row_group_size=d.row_group_size,
        managed=d.managed_mask(),
    )
