"""The shipped model checks: ``check(job) -> list[str]`` each, named in
``register_model(..., checks=...)`` and run by preflight on every run that names the model.

``job`` is the resolved run (``recsys_dist.train.job.Job``, not imported here: it sits above the
models): a check reads its facts (``job.features``: features, tasks, managed features) and the
sections it needs (``job.model``, ``job.data``, ``job.train``), never re-derives them."""

from __future__ import annotations


def needs_dense(job) -> list[str]:
    """The data must have dense features (DLRM's bottom MLP reads them)."""
    if job.features.dense_names:
        return []
    return [
        f"model.name: {job.model.name} needs dense features and {job.data.format} has none; "
        "use dcnv2, deepfm or wide_deep"
    ]


def dot_interaction(job) -> list[str]:
    """dlrm's bottom MLP ends as wide as an embedding (checked when the config is loaded if it
    names ``model.name: dlrm``; here, for the default, once the run trains that model)."""
    problem = job.model.dot_interaction_problem()
    return [problem] if problem else []


def one_task(job) -> list[str]:
    """One label column: the model gives one logit per row (``data.schema.labels`` with several
    tasks needs a multi-task model, whose output is ``[B, num_tasks]``)."""
    names = job.features.tasks
    if len(names) <= 1:
        return []
    return [
        f"model.name: {job.model.name} gives one logit per row and data.schema.labels has {len(names)} tasks; "
        "use a multi-task model (mmoe)"
    ]


def no_sequences(job) -> list[str]:
    """No sequence features: the model reads none, so ``data.schema.sequence`` / ``history``
    would be dropped silently."""
    seq = job.features.sequence_names
    if not seq:
        return []
    schema = job.data.schema
    keys = [f"data.schema.sequence.{n}" for n in schema.sequence] if schema is not None else []
    if schema is not None and schema.history is not None:
        keys.append("data.schema.history")
    return [
        f"model.name: {job.model.name} reads no sequence features, so {', '.join(keys or seq)} would be "
        "dropped; use a model that reads them (din, bst) or remove them from data.schema"
    ]


def no_history_extras(job) -> list[str]:
    """No ``data.schema.history.action`` / ``times``: only ``hstu`` reads them (the actions would
    be read as one more sequence of their own, the times dropped)."""
    schema = job.data.schema
    h = schema.history if schema is not None else None
    if h is None or not (h.action or h.times):
        return []
    keys = [k for k, on in (("data.schema.history.action", h.action), ("data.schema.history.times", h.times)) if on]
    return [
        f"model.name: {job.model.name} does not read {' / '.join(keys)} (only hstu does, with "
        "model.action_tokens / model.time_buckets); remove them from data.schema.history"
    ]
