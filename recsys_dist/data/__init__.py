"""Data: raw Criteo TSV -> Parquet (``criteo``), Parquet -> rank-sharded KJT batches (``loader``)."""

from __future__ import annotations


def prepare_from_config(cfg, progress: bool = False):
    """Convert (or reuse) the Parquet splits described by a run config's ``data`` section."""
    from recsys_dist.data.criteo import prepare_criteo

    d = cfg.data
    return prepare_criteo(d.raw_path, d.num_embeddings, d.split, d.num_rows, d.cache_dir,
                          on_bad_row=d.on_bad_row, progress=progress)
