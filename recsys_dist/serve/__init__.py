"""Serving: a trained model outside the Trainer. Export, evaluate and predict in one process
(``export``), the TorchScript artefact (``torchscript``), int8 / int4 tables (``quantize``), what
scoring reads besides the weights: the preprocessing record and the input file converted with it
(``score_inputs``), scoring over HTTP (``http``; one ``POST /score`` within the server's limits:
``score_request``, ``limits``; its connections: ``connections``; a request's JSON rows, their rules
and the route through a raw file: ``request_rows``, or in memory: ``inmemory``), published versions
(``publish``: a full export, then deltas, written and loaded; ``publish_manifest``: a publish
directory's manifest read and checked; ``publish_owner``: whose a publish directory is, its lock, a
damaged manifest rebuilt; ``publish_callback``: the Trainer callback that publishes while
training), and the ``publish:`` section (``config``). Nothing is re-exported here."""
