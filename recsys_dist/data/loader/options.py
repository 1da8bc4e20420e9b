"""How a :class:`~recsys_dist.data.loader.ParquetBatchLoader` reads, besides its files, batch
size, rank and columns: :class:`LoaderOptions`, built once (the Trainer builds it from the
``data`` section) and passed to every split's loader; :class:`LoaderKeywords` is the same fields
as keyword arguments (``ParquetBatchLoader(..., shuffle=True)``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict


@dataclass(frozen=True)
class LoaderOptions:
    """The options of a :class:`~recsys_dist.data.loader.ParquetBatchLoader`.

    Attributes:
        shuffle: new seeded order each epoch; identical on every rank and every rerun.
        seed: base seed.
        remainder: ``"pad"`` or ``"drop"`` (the loader's module docstring).
        num_embeddings: per sparse feature; an id outside ``[0, n)`` raises DataError. None:
            ids are not checked against a bound.
        shuffle_buffer_rows: rows read and shuffled together (memory bound).
        prefetch: 0 = everything in the calling thread; > 0: a background thread gathers rows
            into blocks of up to ``BLOCK_BATCHES`` batches, ceil(prefetch / BLOCK_BATCHES)
            blocks ahead, and a second one reads the next window meanwhile.
        pin_memory: pin batches (for CUDA).
        rank_reads: ``"global_batch"`` (every rank reads the whole stream and keeps its block
            of each global batch) or ``"row_groups"`` (each rank reads only its own row groups;
            the loader's module docstring).
        label_columns: the label columns, in task order: ``["label"]`` (one task; labels
            [B]) or the conversion's ``label:<task>`` columns (labels [B, T]; [B] for one).
        weight_column: a float32 column of sample weights (>= 0) that the batch weights carry
            (times 0 for padding); None = every real row weighs 1.
        scale_losses: the batches carry ``loss_scale`` (a training loader); False: it is None
            (an evaluation loader: nothing applies it, and a weighted loader on several ranks
            then skips reading the other ranks' weights, ``ParquetBatchLoader.global_weights``).

    Raises:
        ValueError: an unknown ``remainder`` or ``rank_reads``.
    """

    shuffle: bool = False
    seed: int = 0
    remainder: str = "pad"
    num_embeddings: Sequence[int] | None = None
    shuffle_buffer_rows: int = 1 << 20
    prefetch: int = 2
    pin_memory: bool = False
    rank_reads: str = "global_batch"
    label_columns: Sequence[str] = ("label",)
    weight_column: str | None = None
    scale_losses: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "label_columns", tuple(self.label_columns))  # a list given compares equal
        if self.remainder not in ("pad", "drop"):
            raise ValueError(f"remainder must be 'pad' or 'drop', got {self.remainder!r}")
        if self.rank_reads not in ("global_batch", "row_groups"):
            raise ValueError(f"rank_reads must be 'global_batch' or 'row_groups', got {self.rank_reads!r}")

    def changed(self, **changes: object) -> LoaderOptions:
        """These options with ``changes`` (field names as keywords).

        Raises:
            TypeError: a keyword that is not a field, naming the fields.
        """
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"unknown options {unknown}; options are {sorted(names)}")
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


class LoaderKeywords(TypedDict, total=False):
    """:class:`LoaderOptions`' fields as keyword arguments, for type checkers
    (tests/unit/data/test_loader.py keeps the two the same)."""

    shuffle: bool
    seed: int
    remainder: str
    num_embeddings: Sequence[int] | None
    shuffle_buffer_rows: int
    prefetch: int
    pin_memory: bool
    rank_reads: str
    label_columns: Sequence[str]
    weight_column: str | None
    scale_losses: bool
