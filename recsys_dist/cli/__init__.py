"""The ``recsys-dist`` command line: the parser and the dispatch (``main``), and one module per
command: ``train`` (then ``train_run``), ``data`` (``preprocess``), ``plan``, ``inference``
(``export``, ``evaluate``, ``predict``), ``serve``, ``bench``, and ``report`` / ``compare`` (with
``run_metrics``: a run directory read back; ``run_plots``: its PNG plots)."""
