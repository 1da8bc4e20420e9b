"""A ``data`` section resolved: its format object (:func:`data_format`, a lookup in the format
registry ``formats.base.FORMATS``), the facts it decides (:func:`configured_sizes`,
:func:`managed_names`), the checks that need its format (:func:`check_data`) and its conversion
(:func:`conversion_spec`, :func:`prepare_from_config`).

Every function takes the ``data`` section (``DataConfig``) itself, never the run config: the run
is resolved once into a ``recsys_dist.train.job.Job`` whose FeatureSpec carries these facts."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

# The format modules register themselves in FORMATS when imported.
import recsys_dist.data.formats.avazu  # noqa: F401
import recsys_dist.data.formats.criteo  # noqa: F401
import recsys_dist.data.formats.schema  # noqa: F401
from recsys_dist.data import mapping as mp
from recsys_dist.data.config import DataConfig
from recsys_dist.data.convert import entry_path, prepare
from recsys_dist.data.convert.manifest import MANIFEST_FILE, PreparedData
from recsys_dist.data.convert.spec import ConversionSpec
from recsys_dist.data.formats.base import FORMATS, RawFormat
from recsys_dist.errors import DataError
from recsys_dist.section import import_object, is_import_path, typed_arg_problems


def raw_format(name: str, schema=None, short_lines: str = "error", args: dict | None = None) -> RawFormat:
    """The format object of ``data.format``: a registered name (``criteo_tsv``, ``avazu_csv``,
    ``schema`` with its ``data.schema`` section, or one registered with ``register_format``), or
    a factory's import path ``package.module:factory``; ``short_lines``: ``data.short_lines``
    (criteo_tsv only); ``args``: ``data.format_args``, the factory's keyword arguments, checked
    against its signature (names, required ones, annotated types) before it is called. A format
    built with arguments has them in its ``fingerprint`` (the conversion cache key), so that other
    arguments never reuse another conversion.

    Raises:
        ValueError: an unknown format name, a factory that cannot be imported (or whose module
            fails to import), arguments the factory does not take, lacks or cannot convert, a
            factory that raises, or one that does not return a format object; each names
            ``data.format`` or ``data.format_args.<key>``.
    """
    args = dict(args or {})
    if is_import_path(name):
        factory = import_object(name, "data.format")
    elif name in FORMATS:
        factory = FORMATS[name]
    else:
        raise ValueError(
            f"data.format: unknown format {name!r}; registered: {', '.join(sorted(FORMATS))}, or give a factory's "
            "import path 'package.module:factory'"
        )
    if not callable(factory):
        raise ValueError(f"data.format: {name} is not callable; name a format factory")
    args = _checked_args(name, factory, args)
    try:
        fmt = factory(schema, short_lines, **args)
    except ValueError as err:  # the factory's own refusal (DataError, ConfigError are ValueErrors)
        msg = str(err)
        raise ValueError(msg if msg.startswith("data.") else f"data.format: {name}: {msg}") from None
    except Exception as err:  # noqa: BLE001 - the user's code: any failure is a config error naming it
        raise ValueError(
            f"data.format: {name}(schema, short_lines, **data.format_args) raised {type(err).__name__}: {err} "
            f"(data.format_args: {args})"
        ) from err
    missing = [m for m in _FORMAT_MEMBERS if not hasattr(fmt, m)]
    if missing:
        raise ValueError(
            f"data.format: {name} made a {type(fmt).__name__} without {', '.join(missing)}; a format implements "
            "recsys_dist.data.formats.base.RawFormat"
        )
    if args:
        _fingerprint_args(name, fmt, args)
    return fmt


# What the conversion and scoring read of a format object (RawFormat's members).
# (``request_layout`` is optional: a format without it trains, and ``serve`` refuses it by name.)
_FORMAT_MEMBERS = sorted(
    ({m for m in vars(RawFormat) if not m.startswith("_")} | set(RawFormat.__annotations__)) - {"request_layout"}
)


def _fingerprint_args(name: str, fmt, args: dict) -> None:
    # The cache key holds fmt.fingerprint; a factory whose fingerprint leaves out an argument
    # would otherwise reuse a conversion made with other arguments (other columns, other values).
    suffix = "|format_args:" + json.dumps(args, sort_keys=True, default=str)
    if str(fmt.fingerprint).endswith(suffix):  # a factory returning one shared object
        return
    try:
        fmt.fingerprint = f"{fmt.fingerprint}{suffix}"
    except AttributeError:
        raise ValueError(
            f"data.format: {name} made a {type(fmt).__name__} whose fingerprint cannot be set; make it a plain "
            "attribute (recsys_dist adds data.format_args to it, the conversion cache key)"
        ) from None


def _checked_args(name: str, factory, args: dict) -> dict:
    """``args`` checked against ``factory(schema, short_lines, **args)``'s signature: its names,
    its required keyword parameters, and the values against its annotations (pydantic's lax
    conversion, as ``model.args``: a string is not a list of strings); the converted values."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return args
    try:
        sig.bind_partial(None, None)
    except TypeError:
        raise ValueError(
            f"data.format: {name} must take (schema, short_lines, **format_args): the data.schema section (or "
            "None) and data.short_lines first"
        ) from None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = {p.name: p for p in params[min(2, len(positional)) :] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    unknown = sorted(set(args) - set(rest))
    if unknown and not takes_kwargs:
        raise ValueError(
            f"data.format_args: {name} takes no argument {', '.join(map(repr, unknown))}"
            f"{' (it takes ' + ', '.join(rest) + ')' if rest else ' (it takes none): remove data.format_args'}"
        )
    missing = [n for n, p in rest.items() if p.default is p.empty and n not in args]
    if missing:
        raise ValueError(f"data.format_args.{missing[0]}: required by {name}, missing (it takes {', '.join(rest)})")
    args = dict(args)
    problems = typed_arg_problems("data.format_args", name, factory, args)
    if problems:
        raise ValueError(problems[0])
    return args


def data_format(d: DataConfig) -> RawFormat:
    """The format object of a ``data`` section: ``data.format`` with its options."""
    _section(d)
    return raw_format(d.format, d.schema, d.short_lines, d.format_args)


def _section(d) -> None:
    if not isinstance(d, DataConfig):
        raise TypeError(f"expected the data section (DataConfig), got {type(d).__name__}")


def configured_sizes(d: DataConfig, fmt: RawFormat) -> list[int]:
    """Rows per categorical feature's table as configured (``data.num_embeddings``), in
    ``fmt.sparse_names`` order. Under vocabulary mapping the data preparation decides the real
    sizes (``PreparedData.num_embeddings``)."""
    n = d.num_embeddings
    if isinstance(n, list):
        return list(n)
    values = set(getattr(fmt, "value_names", []))  # no table: mp.NO_TABLE_ROWS
    return [mp.NO_TABLE_ROWS if f in values else n for f in fmt.sparse_names]


def managed_names(d: DataConfig, fmt: RawFormat) -> list[str]:
    """The categorical features of ``fmt`` whose ids a managed-collision module maps
    (``categorical_mapping: managed``: all; else ``data.managed.features``), in format order."""
    listed = set(d.managed.features or []) if d.managed is not None else set()
    values = set(getattr(fmt, "value_names", []))
    return [n for n in fmt.sparse_names if n not in values and (d.categorical_mapping == "managed" or n in listed)]


def conversion_spec(d: DataConfig, fmt: RawFormat | None = None) -> ConversionSpec:
    """The conversion a ``data`` section describes: its format object (``fmt``, default
    :func:`data_format`), raw files, table sizes, split, row cap, cache directory, bad-row rule and
    mapping. Built once and passed (``dataclasses.replace`` it for another file: a stream's
    partition, rows to score)."""
    fmt = fmt if fmt is not None else data_format(d)
    managed = set(managed_names(d, fmt))
    return ConversionSpec(
        fmt,
        d.raw_path,
        d.num_embeddings,
        d.split,
        num_rows=d.num_rows,
        cache_dir=d.cache_dir,
        row_group_size=d.row_group_size,
        on_bad_row=d.on_bad_row,
        mapping=d.categorical_mapping,
        min_count=d.min_count,
        managed=[n in managed for n in fmt.sparse_names],
    )


def prepare_from_config(d: DataConfig, progress: bool = False, fmt: RawFormat | None = None) -> PreparedData:
    """Convert (or reuse) the Parquet splits a ``data`` section describes.

    Returns ``PreparedData``; its ``num_embeddings`` are the table sizes to train with
    (from the vocabulary under ``data.categorical_mapping: vocabulary``).
    """
    return prepare(conversion_spec(d, fmt), progress=progress)


def cached_conversion(d: DataConfig) -> tuple[Path | None, str]:
    """(the conversion-cache entry :func:`prepare_from_config` would reuse, or None; why None).
    Nothing is converted or read besides the raw files' sizes and times.

    An entry is None when ``data.raw_path`` is not set or names a missing file, ``data.stream``
    is set (partitions are converted as they land), or the data is not converted yet."""
    _section(d)
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


def check_data(d: DataConfig) -> None:
    """The checks of a ``data`` section that need its format's feature and column names
    (``DataConfig`` checks the rest itself; ``RunConfig`` runs this on its ``data``).

    Raises:
        ValueError: the first problem, as ``data.<key>: what is wrong``.
    """
    fmt = data_format(d)
    _check_mapping(d, fmt, _check_features(d, fmt))


def _check_features(d: DataConfig, fmt: RawFormat) -> list[int]:
    n_features = len(fmt.sparse_names)
    known = fmt.raw_columns  # None: known once the file is read (schema formats)
    if d.split.by in ("time", "leave_last_out") and d.format != "schema" and known is not None:
        for key in ("column", "user"):
            name = getattr(d.split, key)
            if name is not None and name not in known:
                raise ValueError(f"data.split.{key}: {name!r} is not a raw column of {d.format} ({', '.join(known)})")
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
    # categorical_mapping: managed maps the sequence features' ids too (s_<feature> tables,
    # tests/e2e/models/test_managed_hstu.py); listing one in data.managed.features is untested.
    listed = (d.managed.features or []) if d.managed is not None else []
    managed_seq = [f for f in listed if f in fmt.sequence_names] if d.categorical_mapping != "managed" else []
    if managed_seq:
        raise ValueError(
            f"data.managed.features: {', '.join(managed_seq)}: a sequence feature's table is managed only under "
            f"data.categorical_mapping: managed (all features); leave it out of data.managed.features"
        )
    every = sizes * len(fmt.sparse_names) if len(sizes) == 1 else sizes
    managed = set(managed_names(d, fmt))
    if any(n > 2**62 for n, f in zip(every, fmt.sparse_names) if f in managed):
        raise ValueError(
            f"data.num_embeddings: a managed table's rows (zch_size) must be below the 63-bit id space, "
            f"got {d.num_embeddings}"
        )
    if any(n < 2 for n in sizes):
        raise ValueError(
            f"data.num_embeddings must be >= 2 (row 0 is reserved for missing values), got {d.num_embeddings}"
        )
