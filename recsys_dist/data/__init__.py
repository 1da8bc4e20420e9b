"""Data: raw files -> Parquet (``convert`` with the ``criteo`` / ``avazu`` formats),
Parquet -> rank-sharded KJT batches (``loader``)."""

from __future__ import annotations


def raw_format(name: str):
    """The format object for ``data.format`` (``criteo_tsv`` or ``avazu_csv``)."""
    if name == "avazu_csv":
        from recsys_dist.data.avazu import AVAZU

        return AVAZU
    from recsys_dist.data.criteo import CRITEO

    return CRITEO


def feature_names(cfg) -> tuple[list[str], list[str]]:
    """(dense, categorical) feature names of a run config's data format, in model order."""
    fmt = raw_format(cfg.data.format)
    return list(fmt.dense_names), list(fmt.sparse_names)


def prepare_from_config(cfg, progress: bool = False):
    """Convert (or reuse) the Parquet splits described by a run config's ``data`` section."""
    from recsys_dist.data.convert import prepare

    d = cfg.data
    return prepare(raw_format(d.format), d.raw_path, d.num_embeddings, d.split, d.num_rows, d.cache_dir,
                   on_bad_row=d.on_bad_row, progress=progress)
