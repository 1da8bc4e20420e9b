"""What one conversion reads and how it maps it: :class:`ConversionSpec`, built once (from a
``data`` section by ``recsys_dist.data.resolve.conversion_spec``, or by hand) and passed to
``prepare`` / ``entry_path``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from recsys_dist.data.config import SplitConfig
from recsys_dist.data.formats.base import RawFormat
from recsys_dist.data.splits import Split

RawPath = str | os.PathLike[str]


@dataclass(frozen=True)
class ConversionSpec:
    """Every setting that changes a conversion's output, and so names its cache entry.

    Attributes:
        fmt: the format object that reads the raw files (``formats.base.RawFormat``: ``CRITEO``,
            ``AVAZU``, a ``SchemaFormat``).
        raw_path: the raw file, or several (the training files of ``split.by: files``).
        num_embeddings: table rows per categorical feature (one int for all); under
            ``mapping="vocabulary"`` the largest table allowed (the most frequent values are kept).
        split: three fractions (position split, file order), a :class:`splits.Split` or the
            ``data.split`` section (position, random with a seed, a time column, one file per split).
        num_rows: read at most this many rows of each raw file; None: every row.
        cache_dir: the directory of cache entries; None: ``$RECSYS_DIST_CACHE``, else
            ``~/.cache/recsys_dist``.
        row_group_size: rows per Parquet row group.
        on_bad_row: ``"error"`` (stop at the first, naming it) or ``"skip"`` (leave bad rows out
            and count them in the manifest).
        mapping: ``"hash"``, ``"vocabulary"`` or ``"managed"`` (``recsys_dist.data.mapping``); the
            vocabulary is built from the training split only (a first pass over its rows).
        min_count: vocabulary: keep a value seen at least this often in the training rows.
        vocabulary: vocabulary: apply this ``vocabulary.parquet`` (from an earlier conversion,
            e.g. the training data when scoring new rows) instead of counting.
        managed: per categorical feature, True where a managed-collision module maps its ids
            (its raw keys are kept); None: no feature (all of them under ``mapping="managed"``).
    """

    fmt: RawFormat
    raw_path: RawPath | Sequence[RawPath] | None
    num_embeddings: int | Sequence[int]
    split: Split | SplitConfig | Sequence[float] = (0.8, 0.1, 0.1)
    num_rows: int | None = None
    cache_dir: RawPath | None = None
    row_group_size: int = 65536
    on_bad_row: str = "error"
    mapping: str = "hash"
    min_count: int = 1
    vocabulary: RawPath | None = None
    managed: Sequence[bool] | None = None
