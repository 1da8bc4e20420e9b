"""Training: the resolved run (``job``); checks before launch (``preflight``, ``section_checks``,
``batch_memory``); the ``Trainer`` (``trainer``) and its parts (``build``: the loaders and the
sharded model; ``dry_run``: the plan for any cluster, without one; ``loop``: the step loop and its checkpoints; ``pipelines``: TorchRec's training
pipelines; ``schedule``: the learning-rate schedule; ``early_stopping``, ``best_weights``;
``summary``, ``results``: what ``fit()`` returns); online training (``stream``; where it is
across restarts: ``stream_state``); global metrics and predictions (``metrics``,
``evaluation``); what a run records (``metrics_writer``, ``observe``); starting ranks (``run``,
``launch``, ``worker``, ``rank_failure``); and the ``train:`` section (``config``). Nothing is
re-exported here."""
