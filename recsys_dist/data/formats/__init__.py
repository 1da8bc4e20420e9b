"""Raw input formats: the interface and registry (``base``), and one module per format:
``criteo`` (Criteo TSV), ``avazu`` (Avazu CSV), ``schema`` (any CSV / TSV / Parquet described by
``data.schema``; its user histories: ``history``; its request side: ``schema_request``); which raw columns hold ids keyed by their
text (``ids``)."""
