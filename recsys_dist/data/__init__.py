"""Data: raw files -> cached Parquet splits (``convert``; the formats in ``formats/``, read through ``text``),
Parquet -> rank-sharded KJT batches (``loader``), and the run's features (``spec.FeatureSpec``,
``resolve``). Imports only ``errors`` and ``config.base`` from below; nothing is re-exported here."""
