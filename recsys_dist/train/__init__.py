"""Training: the resolved run (``job``), checks before launch (``preflight``), the ``Trainer``
(``trainer``), pipelines, evaluation, metrics, observability, and starting ranks (``launch``).
Nothing is re-exported here."""
