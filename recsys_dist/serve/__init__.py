"""Serving: a trained model outside the Trainer. Export, evaluate and predict in one process
(``export``), the TorchScript artefact (``torchscript``), int8 / int4 tables (``quantize``), what
scoring needs besides the weights and how raw rows become model inputs (``scoring``), scoring
over HTTP (``http``; one request within the server's limits: ``request``, ``limits``; its
connections: ``connections``; a request's JSON rows through a raw file: ``rows``, or in memory:
``inmemory``), published versions (``publish``: a full export, then deltas; ``manifest``: a
publish directory read and checked; ``publishing``: the Trainer callback that publishes while
training), and the ``publish:`` section (``config``). Nothing is re-exported here."""
