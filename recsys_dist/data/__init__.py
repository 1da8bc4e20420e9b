"""Data: raw files -> cached Parquet splits (``convert``; the formats in ``formats/``, read through
``text``; rows to splits: ``splits``, configured by ``split_config``; keys to table rows: ``mapping``; the tables' coverage:
``coverage``; worker processes: ``workers``), Parquet -> rank-sharded KJT batches (``loader``,
reading through ``parquet_io``, ahead of use with ``prefetch``), partitions of a stream
(``stream``), raw rows -> model batches for scoring (``encode``), the run's features (``spec.FeatureSpec``, ``resolve``), the preprocessing record
scoring reads (``record``) and the ``data:`` section (``config``). Imports only ``errors`` and
``section`` from below; nothing is re-exported here."""
