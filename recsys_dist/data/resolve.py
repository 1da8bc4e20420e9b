"""A ``data`` section resolved: its format object (:func:`raw_format`, a lookup in the format
registry ``formats.base.FORMATS``), the feature names, tasks and label columns the format gives,
the checks that need them (:func:`check_data`), the managed-collision features
(:func:`managed_mask`) and its conversion (:func:`conversion_spec`, :func:`prepare_from_config`).

Functions taking ``cfg`` accept a ``data`` section or anything with one as ``.data`` (a run config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The format modules register themselves in FORMATS when imported.
import recsys_dist.data.formats.avazu  # noqa: F401
import recsys_dist.data.formats.criteo  # noqa: F401
import recsys_dist.data.formats.schema  # noqa: F401
from recsys_dist.data.config import DataConfig
from recsys_dist.data.convert import entry_path, prepare
from recsys_dist.data.convert.manifest import MANIFEST_FILE, PreparedData
from recsys_dist.data.convert.spec import ConversionSpec
from recsys_dist.data.formats.base import FORMATS, RawFormat
from recsys_dist.data.mapping import MANAGED_ID_SPACE
from recsys_dist.errors import DataError


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


def conversion_spec(cfg: DataConfig | Any) -> ConversionSpec:
    """The conversion a ``data`` section (or a run config's) describes: its format object, raw
    files, table sizes, split, row cap, cache directory, bad-row rule and mapping. Built once and
    passed (``dataclasses.replace`` it for another file: a stream's partition, rows to score)."""
    d = getattr(cfg, "data", cfg)
    return ConversionSpec(
        _format_of(d),
        d.raw_path,
        d.num_embeddings,
        d.split,
        num_rows=d.num_rows,
        cache_dir=d.cache_dir,
        row_group_size=d.row_group_size,
        on_bad_row=d.on_bad_row,
        mapping=d.categorical_mapping,
        min_count=d.min_count,
        managed=managed_mask(d),
    )


def prepare_from_config(cfg: DataConfig | Any, progress: bool = False) -> PreparedData:
    """Convert (or reuse) the Parquet splits described by a ``data`` section (or a run config's).

    Returns ``PreparedData``; its ``num_embeddings`` are the table sizes to train with
    (from the vocabulary under ``data.categorical_mapping: vocabulary``).
    """
    return prepare(conversion_spec(cfg), progress=progress)


def cached_conversion(cfg: DataConfig | Any) -> tuple[Path | None, str]:
    """(the conversion-cache entry :func:`prepare_from_config` would reuse, or None; why None).
    Nothing is converted or read besides the raw files' sizes and times.

    An entry is None when ``data.raw_path`` is not set or names a missing file, ``data.stream``
    is set (partitions are converted as they land), or the data is not converted yet."""
    d = getattr(cfg, "data", cfg)
    if d.stream is not None:
        return None, "data.stream: each partition is converted as it lands"
    if d.raw_path is None:
        return None, "data.raw_path is not set"
    try:
        out = entry_path(conversion_spec(d))
    except (DataError, ValueError) as err:
        return None, str(err)
    if not (out / MANIFEST_FILE).is_file():
        return None, f"the data is not converted yet (recsys-dist preprocess converts it into {out})"
    return out, ""


def managed_mask(cfg: DataConfig | Any) -> list[bool]:
    """Per categorical feature of ``data.format`` (in its order): True where a managed-collision
    module maps its ids (``categorical_mapping: managed``: all; else ``data.managed.features``)."""
    d = getattr(cfg, "data", cfg)
    listed = set(d.managed.features or []) if d.managed is not None else set()
    names = raw_format(d.format, d.schema).sparse_names
    return [d.categorical_mapping == "managed" or n in listed for n in names]


def managed_features(cfg: DataConfig | Any) -> list[str]:
    """Names of the categorical features with managed-collision tables (see :func:`managed_mask`)."""
    d = getattr(cfg, "data", cfg)
    if d.categorical_mapping != "managed" and (d.managed is None or not d.managed.features):
        return []
    names = raw_format(d.format, d.schema).sparse_names
    return [n for n, m in zip(names, managed_mask(d)) if m]


def loader_id_bounds(cfg: DataConfig | Any, sizes: list[int]) -> list[int]:
    """Per feature, the bound a loader checks ids against: the table size, or for a feature with
    a managed-collision table (``data.categorical_mapping: managed``, ``data.managed.features``)
    the raw id space (rows come from the managed module)."""
    return [MANAGED_ID_SPACE if m else n for n, m in zip(sizes, managed_mask(cfg))]


def check_data(d: DataConfig) -> None:
    """The checks of a ``data`` section that need its format's feature and column names
    (``DataConfig`` checks the rest itself; ``RunConfig`` runs this on its ``data``).

    Raises:
        ValueError: the first problem, as ``data.<key>: what is wrong``.
    """
    fmt = raw_format(d.format, d.schema)
    _check_mapping(d, fmt, _check_features(d, fmt))


def _check_features(d: DataConfig, fmt: RawFormat) -> list[int]:
    n_features = len(fmt.sparse_names)
    if d.split.by == "time" and d.format != "schema" and d.split.column not in fmt.raw_columns:
        raise ValueError(
            f"data.split.column: {d.split.column!r} is not a raw column of {d.format} ({', '.join(fmt.raw_columns)})"
        )
    sizes = d.num_embeddings if isinstance(d.num_embeddings, list) else [d.num_embeddings]
    if isinstance(d.num_embeddings, list) and len(sizes) != n_features:
        raise ValueError(
            f"data.num_embeddings: expected one int or a list of {n_features} ({d.format} "
            f"features), got a list of {len(sizes)}"
        )
    if d.multi_hot_sizes is not None and (
        len(d.multi_hot_sizes) != n_features or any(h <= 0 for h in d.multi_hot_sizes)
    ):
        raise ValueError(f"data.multi_hot_sizes: expected {n_features} positive ints, got {d.multi_hot_sizes}")
    unknown = sorted(set(d.feature_pooling) - set(fmt.sparse_names))
    if unknown:
        raise ValueError(
            f"data.feature_pooling: {unknown} are not categorical features of {d.format} "
            f"({', '.join(fmt.sparse_names)})"
        )
    unpooled = sorted(set(d.feature_pooling) & set(fmt.sequence_names))
    if unpooled:
        raise ValueError(
            f"data.feature_pooling: {unpooled} are sequence features, which are not pooled (one embedding "
            "per position); remove them"
        )
    return sizes


def _check_mapping(d: DataConfig, fmt: RawFormat, sizes: list[int]) -> None:
    if d.categorical_mapping == "managed" and d.managed is None:
        raise ValueError("data.managed: required with categorical_mapping: managed (at least eviction_interval)")
    if d.categorical_mapping == "managed" and d.managed.features is not None:
        raise ValueError(
            "data.managed.features: not used with categorical_mapping: managed (every feature is managed); "
            "remove it, or set categorical_mapping: hash or vocabulary for the features not listed"
        )
    if d.categorical_mapping != "vocabulary" and d.min_count != 1:
        hint = (
            "; managed tables admit an id seen often enough with data.managed.admission_min_count"
            if d.categorical_mapping == "managed"
            else ""
        )
        raise ValueError(
            f"data.min_count: {d.min_count} is only used with categorical_mapping: vocabulary (a value seen "
            f"fewer times gets the out-of-vocabulary id), not {d.categorical_mapping}, which keeps no "
            f"vocabulary: remove min_count, or use categorical_mapping: vocabulary{hint}"
        )
    if d.categorical_mapping != "managed" and d.managed is not None and not d.managed.features:
        raise ValueError(
            f"data.managed: only used with categorical_mapping: managed, or with data.managed.features "
            f"(managed tables for some features, {d.categorical_mapping} for the rest); not with "
            f"categorical_mapping: {d.categorical_mapping} alone"
        )
    if d.managed is not None and d.managed.features:
        listed = d.managed.features
        twice = sorted({f for f in listed if listed.count(f) > 1})
        unknown = [f for f in listed if f not in fmt.sparse_names and f not in fmt.sequence_names]
        if twice or unknown:
            raise ValueError(
                f"data.managed.features: {'listed twice: ' + str(twice) if twice else ''}"
                f"{'; ' if twice and unknown else ''}"
                f"{'not categorical features of ' + d.format + ': ' + str(unknown) if unknown else ''} "
                f"(features: {', '.join(fmt.sparse_names)})"
            )
    seq = list(fmt.sequence_names)
    listed = (d.managed.features or []) if d.managed is not None else []
    managed_seq = seq if d.categorical_mapping == "managed" else [f for f in listed if f in seq]
    if managed_seq:
        keys = [f"data.schema.sequence.{n}" for n in d.schema.sequence] if d.schema else []
        if d.schema is not None and d.schema.history is not None:
            keys.append("data.schema.history")
        if d.categorical_mapping != "managed":
            keys = [f"data.managed.features: {', '.join(managed_seq)}"]
        raise ValueError(
            f"data.categorical_mapping: managed tables for sequence features are not supported yet "
            f"({', '.join(keys or seq)}); use categorical_mapping: hash or vocabulary, or drop the sequence features"
        )
    every = sizes * len(fmt.sparse_names) if len(sizes) == 1 else sizes
    if any(n > 2**62 for n, m in zip(every, managed_mask(d)) if m):
        raise ValueError(
            f"data.num_embeddings: a managed table's rows (zch_size) must be below the 63-bit id space, "
            f"got {d.num_embeddings}"
        )
    if any(n < 2 for n in sizes):
        raise ValueError(
            f"data.num_embeddings must be >= 2 (row 0 is reserved for missing values), got {d.num_embeddings}"
        )
