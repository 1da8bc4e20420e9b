"""Raw rows -> model batches: :class:`Encoder`, the one encoding that training, ``predict`` and
``POST /score`` share.

A row becomes model input in two steps, each with one implementation:

1. raw columns -> converted columns (labels, dense values, ids): the training conversion's
   ``convert.passes.Transform`` (the format's ``parse_batch``, its dense transform and keys, then
   the hash, vocabulary or managed id rule). ``recsys-dist preprocess`` / ``train`` and ``predict``
   run it over a file (``data.convert.prepare``) and write Parquet; :meth:`Encoder.convert` runs it
   on a table in memory.
2. converted columns -> :class:`~recsys_dist.data.loader.batch.CTRBatch` (dense float32 [B, D], a
   KeyedJaggedTensor of int64 ids, labels, weights): ``loader.batch.BatchLayout``, with the
   loader's checks (ids within the tables, finite dense values and labels). The loader
   (``ParquetBatchLoader``: training, evaluation and ``predict``) uses it on each window it reads;
   :meth:`Encoder.batches` on converted rows in memory.

So a row gives the same tensors whichever path it takes (tests/unit/serve/test_one_encoder.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa

from recsys_dist.data import mapping as mp
from recsys_dist.data.config import DataConfig
from recsys_dist.data.convert.passes import Transform
from recsys_dist.data.formats.base import TRANSFORM_VERSION, RawFormat  # noqa: F401 - serve compares a record's
from recsys_dist.data.loader.batch import BatchLayout, CTRBatch
from recsys_dist.data.loader.columns import Columns
from recsys_dist.data.resolve import configured_sizes
from recsys_dist.data.spec import FeatureSpec

BATCH_ROWS = 4096  # rows per batch at most: predict's batch size (recsys_dist.serve.export.score)


class Encoder:
    """Raw rows of one model's format -> its batches, as its training conversion and the loader
    make them (see the module doc).

    Args:
        reader: ``reader() -> RawFormat``: the format object that reads a table of raw columns
            (``RawFormat.request_layout().reader``); called again per :meth:`convert` where ``stateful``.
        data: the model's ``data`` section (its configured table sizes).
        features: the model's FeatureSpec (dense names, keys, id bounds, managed features).
        vocabulary: the model's ``vocabulary.parquet`` under vocabulary mapping, else None.
        batch_rows: rows per batch at most.
        stateful: the reader keeps state while rows stream by (user histories): a new one per call.

    Attributes:
        sizes: the table size per feature as the conversion makes them: the configured ones, a
            vocabulary's size in place of a vocabulary feature's (``convert._Conversion``).
    """

    def __init__(
        self,
        reader: Callable[[], RawFormat],
        data: DataConfig,
        features: FeatureSpec,
        vocabulary: Path | None = None,
        batch_rows: int = BATCH_ROWS,
        stateful: bool = True,
    ) -> None:
        self.reader, self.stateful = reader, stateful
        self.fmt = fmt = reader()
        # raw keys, no reduction: managed-collision ids and raw-valued features (value_names)
        self.managed = [n in features.managed or n in features.value_names for n in fmt.sparse_names]
        self.vocabs = None if vocabulary is None else mp.load_vocabularies(vocabulary, list(fmt.sparse_names))
        sizes = configured_sizes(data, fmt)
        if self.vocabs is not None:
            sizes = [s if m else v.size for s, v, m in zip(sizes, self.vocabs, self.managed)]
        self.sizes = sizes
        self.transform = self._transform(fmt)
        self.layout = BatchLayout(
            features.dense_names, features.keys, list(fmt.label_columns), batch_rows, id_bounds=features.id_bounds
        )

    def _transform(self, fmt: RawFormat) -> Transform:
        return Transform(fmt, self.sizes, self.vocabs, fmt.output_schema(), self.managed)

    def convert(self, table: pa.Table, path: str, fmt: RawFormat | None = None) -> list[pa.RecordBatch]:
        """The converted columns of the raw ``table`` (text columns as the format reads them), block
        by block as the conversion transforms a file (``passes.Reader.batches``). ``path``: the file
        the rows stand for (a ``.parquet`` name: rows as a Parquet file has them; errors name it);
        ``fmt``: another format object than the reader (one that read text lines from a file).

        Raises:
            DataError: a value the format's transforms reject.
        """
        transform = self.transform
        if fmt is not None or self.stateful:
            fmt = fmt or self.reader()
            transform = self._transform(fmt)
        out, kept = [], 0
        for batch in table.combine_chunks().to_batches():
            if batch.num_rows:
                out.append(transform(batch, path, kept)[0])
            kept += batch.num_rows
        return out

    def columns(self, converted: list[pa.RecordBatch]) -> Columns:
        """Converted blocks as the loader's checked numpy columns (``BatchLayout.columns``).

        Raises:
            DataError: an id outside its table, a non-finite dense value or label.
        """
        schema = converted[0].schema if converted else self.transform.schema
        return self.layout.columns(pa.Table.from_batches(converted, schema))

    def batches(self, cols: Columns) -> Iterator[CTRBatch]:
        """Every row of ``cols`` in order, in batches of at most ``batch_rows`` rows, each of
        exactly its rows (``BatchLayout.batches``)."""
        return self.layout.batches(cols)

    def encode(self, table: pa.Table, path: str, fmt: RawFormat | None = None) -> Iterator[CTRBatch]:
        """The raw ``table``'s batches (:meth:`convert`, :meth:`columns`, :meth:`batches`); every row
        is converted and checked before the first batch is made.

        Raises:
            DataError: as :meth:`convert` and :meth:`columns`.
        """
        return self.batches(self.columns(self.convert(table, path, fmt)))
