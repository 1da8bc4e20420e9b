"""Training: the resolved run (``job``); checks before launch (``preflight``, ``section_checks``,
``batch_memory``); the ``Trainer`` (``trainer``) composed by role: its data source
(``data_source``: epochs over converted files; ``stream``: partitions as they land, where it is
across restarts in ``stream_state``), its step runner (``steps``), its recorder (``recorder``),
its checkpoints (``checkpointing``) and its process group and run-directory lock (``lease``);
what it builds (``build``: the loaders, the model, the plan and the sharded model; ``dry_run``:
the plan for any cluster, without one); ``pipelines``: TorchRec's training pipelines; ``stage_pipeline``: one step with the dense tower in
pipeline stages;
``schedule``: the learning-rate schedule; ``early_stopping``, ``best_weights``; ``callbacks``: the
user's hooks; ``summary``, ``results``: what ``fit()`` returns; global metrics and predictions
(``metrics``, ``evaluation``); what a run records (``metrics_writer``, ``observe``); starting
ranks (``run``, ``launch``, ``forkserver_init``, ``worker``, ``rank_failure``); and the ``train:`` section
(``config``). Nothing is re-exported here."""
