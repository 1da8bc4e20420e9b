"""Data: raw files -> Parquet (``convert`` with the ``criteo`` / ``avazu`` / ``schema`` formats),
Parquet -> rank-sharded KJT batches (``loader``)."""

from __future__ import annotations


def _criteo(schema, short_lines: str = "error"):
    from recsys_dist.data.criteo import CRITEO, CriteoFormat

    return CRITEO if short_lines == "error" else CriteoFormat(short_lines=short_lines)


def _avazu(schema):
    from recsys_dist.data.avazu import AVAZU

    return AVAZU


def _schema(schema):
    from recsys_dist.data.schema import SchemaFormat

    if schema is None:
        raise ValueError("data.format 'schema' needs a data.schema section")
    return SchemaFormat(schema)


# data.format -> a function of the data.schema section giving the format object.
FORMATS = {"criteo_tsv": _criteo, "avazu_csv": _avazu, "schema": _schema}


def raw_format(name: str, schema=None, short_lines: str = "error"):
    """The format object for ``data.format`` (``criteo_tsv``, ``avazu_csv``, or ``schema`` with
    its ``data.schema`` section); ``short_lines``: ``data.short_lines`` (criteo_tsv only).

    Raises:
        ValueError: an unknown format name.
    """
    if name not in FORMATS:
        raise ValueError(f"data.format: unknown format {name!r}; known: {', '.join(FORMATS)}")
    if name == "criteo_tsv":
        return _criteo(schema, short_lines)
    return FORMATS[name](schema)


def _format_of(d):
    """The format object of a ``data`` section."""
    return raw_format(d.format, d.schema, getattr(d, "short_lines", "error"))


def feature_names(cfg) -> tuple[list[str], list[str]]:
    """(dense, categorical) feature names of a ``data`` section's format (or a run config's), in model order."""
    d = getattr(cfg, "data", cfg)
    fmt = raw_format(d.format, d.schema)
    return list(fmt.dense_names), list(fmt.sparse_names)


def prepare_from_config(cfg, progress: bool = False):
    """Convert (or reuse) the Parquet splits described by a run config's ``data`` section.

    Returns ``PreparedData``; its ``num_embeddings`` are the table sizes to train with
    (from the vocabulary under ``data.categorical_mapping: vocabulary``).
    """
    from recsys_dist.data.convert import prepare

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
    )


def prepare_for_scoring(cfg, data):
    """Convert a raw file of the config's format, all rows as one split (``files["train"]``),
    with the mapping the model was trained with: the same table sizes, and under vocabulary
    mapping the training data's vocabulary (converting the training data first if its
    conversion is not cached; ``data.raw_path`` must then exist). A Criteo file whose first
    line has 39 fields is read as Kaggle's unlabelled test layout (format
    ``criteo_tsv_unlabelled`` in its manifest; its labels are placeholders).

    Raises:
        DataError: malformed input, or (vocabulary) the training data cannot be found.
    """
    from pathlib import Path

    from recsys_dist.data.convert import VOCABULARY_FILE, prepare
    from recsys_dist.data.errors import DataError

    d = getattr(cfg, "data", cfg)
    vocabulary = None
    if d.categorical_mapping == "vocabulary":
        from recsys_dist.data.config import raw_paths

        if d.raw_path is None or not all(Path(r).is_file() for r in raw_paths(d)):
            raise DataError(
                f"{data}: the model maps categories with a vocabulary built on its training data, "
                f"and that data ({d.raw_path}) is not there to rebuild it"
            )
        vocabulary = prepare_from_config(d).directory / VOCABULARY_FILE
    fmt = _format_of(d)
    if d.format == "criteo_tsv" and Path(data).is_file():
        from recsys_dist.data.criteo import NUM_DENSE, NUM_SPARSE, CriteoFormat, first_line_fields

        if first_line_fields(data) == NUM_DENSE + NUM_SPARSE:
            # Kaggle's test.txt: predict only, labels unknown
            fmt = CriteoFormat(labelled=False, short_lines=fmt.short_lines)
    return prepare(
        fmt,
        data,
        d.num_embeddings,
        (1.0, 0.0, 0.0),
        cache_dir=d.cache_dir,
        row_group_size=d.row_group_size,
        mapping=d.categorical_mapping,
        min_count=d.min_count,
        vocabulary=vocabulary,
        warn_one_class=False,
    )  # scoring: one class is no problem
