"""The shipped model checks: ``check(cfg: RunConfig) -> list[str]`` each, named in
``register_model(..., checks=...)`` and run by preflight on every config that names the model."""

from __future__ import annotations

from recsys_dist.data.resolve import feature_names, sequence_names, tasks


def needs_dense(cfg) -> list[str]:
    """The data must have dense features (DLRM's bottom MLP reads them)."""
    dense, _ = feature_names(cfg)
    if dense:
        return []
    return [
        f"model.name: {cfg.model.name} needs dense features and {cfg.data.format} has none; "
        "use dcnv2, deepfm or wide_deep"
    ]


def dot_interaction(cfg) -> list[str]:
    """dlrm's bottom MLP ends as wide as an embedding (checked when the config is loaded if it
    names ``model.name: dlrm``; here, for the default, once the run trains that model)."""
    problem = cfg.model.dot_interaction_problem()
    return [problem] if problem else []


def one_task(cfg) -> list[str]:
    """One label column: the model gives one logit per row (``data.schema.labels`` with several
    tasks needs a multi-task model, whose output is ``[B, num_tasks]``)."""
    names, _ = tasks(cfg)
    if len(names) <= 1:
        return []
    return [
        f"model.name: {cfg.model.name} gives one logit per row and data.schema.labels has {len(names)} tasks; "
        "use a multi-task model (mmoe)"
    ]


def no_sequences(cfg) -> list[str]:
    """No sequence features: the model reads none, so ``data.schema.sequence`` / ``history``
    would be dropped silently."""
    seq = sequence_names(cfg)
    if not seq:
        return []
    schema = cfg.data.schema
    keys = [f"data.schema.sequence.{n}" for n in schema.sequence] if schema is not None else []
    if schema is not None and schema.history is not None:
        keys.append("data.schema.history")
    return [
        f"model.name: {cfg.model.name} reads no sequence features, so {', '.join(keys or seq)} would be "
        "dropped; use a model that reads them (din, bst) or remove them from data.schema"
    ]
