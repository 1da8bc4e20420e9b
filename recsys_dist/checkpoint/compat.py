"""Whether a checkpoint may be resumed by a run config: the settings that give the saved
weights their meaning must be the same (no torch needed: it compares ``meta.json`` with the
resolved config)."""

from __future__ import annotations

from pathlib import Path

from recsys_dist.errors import CheckpointError


def check_compatible(
    path: Path,
    meta: dict,
    config: dict,
    tables: bool = True,
    sizes: list[int] | None = None,
    world_size: int | None = None,
    user_model: bool = False,
) -> None:
    """Refuse a checkpoint written by a model config other than ``config`` (a resolved
    config dict): the model section, the table sizes (unless ``tables`` is False: sizes
    that come from a vocabulary are only known once the data is converted; ``sizes``, the
    sizes the data preparation decided, are compared with the checkpoint's when both are
    known), the pooling of each feature, ``data.categorical_mapping``, ``data.managed``,
    the sequence features (``data.schema.sequence`` / ``history``), the optimizers and the
    tasks (names, order, kinds of ``data.schema.labels``) must match; sharding, world size,
    batch size and schedule may differ, except that under managed tables the global batch
    (``train.batch_size`` x ``world_size``, the ranks of the resumed run, when given) must
    not: the replicated managed-collision history is sized by it.

    ``user_model``: the resuming Trainer was given its model (``Trainer(model=...)``); a
    checkpoint of such a model resumes only into one, and one of ``model.name`` only into that.

    Raises:
        CheckpointError: naming each differing key, old -> new.
    """
    saved = meta.get("config", {})
    diffs = []
    if bool(meta.get("user_model")) != user_model:
        where = ("given to Trainer(model=...)", "named by the config's model.name")
        old, new = where if meta.get("user_model") else where[::-1]
        diffs.append(f"model {old} -> {new} (a model given in Python resumes only into a Trainer given it)")
    for section, keys in (
        ("model", None),
        ("data", (("num_embeddings",) if tables else ()) + ("pooling", "feature_pooling", "categorical_mapping")),
        ("train", ("embedding_optimizer", "dense_optimizer")),
    ):
        old, new = saved.get(section, {}), config.get(section, {})
        names = list(new) if keys is None else keys
        # A key the checkpoint's config lacks was added since it was written: nothing to compare.
        names = [k for k in names if k in old or section == "model"]
        diffs += [f"{section}.{k} {old.get(k)!r} -> {new.get(k)!r}" for k in names if old.get(k) != new.get(k)]
    if _tasks(saved) != _tasks(config):  # the output columns' meaning: names, order and kinds
        diffs.append(f"tasks (data.schema.labels) {_tasks(saved)} -> {_tasks(config)}")
    old_data, new_data = saved.get("data", {}), config.get("data", {})
    old_m, new_m = old_data.get("managed"), new_data.get("managed")
    if isinstance(old_m, dict) and isinstance(new_m, dict):
        diffs += [
            f"data.managed.{k} {old_m.get(k)!r} -> {new_m.get(k)!r}"
            for k in sorted(set(old_m) | set(new_m))
            if old_m.get(k) != new_m.get(k)
        ]
    elif old_m != new_m and "categorical_mapping" in old_data:
        diffs.append(f"data.managed {old_m!r} -> {new_m!r}")
    old_s, new_s = old_data.get("schema") or {}, new_data.get("schema") or {}
    for k in ("sequence", "history"):
        o, n = old_s.get(k) or None, new_s.get(k) or None  # {} and None both: no such features
        if k == "history" and isinstance(o, dict) and isinstance(n, dict) and "action_values" not in o:
            n = {key: v for key, v in n.items() if key != "action_values"}  # added since the checkpoint
        if o != n:
            diffs.append(f"data.schema.{k} {o!r} -> {n!r}")
    if sizes is not None and meta.get("num_embeddings") not in (None, list(sizes)):
        diffs.append(f"table sizes {meta['num_embeddings']} -> {list(sizes)}")
    managed_now = new_data.get("categorical_mapping") == "managed" or (new_data.get("managed") or {}).get("features")
    if managed_now and world_size is not None and "world_size" in meta:
        old_b, new_b = saved.get("train", {}).get("batch_size"), config.get("train", {}).get("batch_size")
        if old_b is not None and new_b is not None and old_b * meta["world_size"] != new_b * world_size:
            diffs.append(
                f"global batch (train.batch_size x ranks) {old_b} x {meta['world_size']} = "
                f"{old_b * meta['world_size']} -> {new_b} x {world_size} = {new_b * world_size} "
                "(managed tables' replicated history is sized by it; keep it equal"
                + (
                    f", train.batch_size={old_b * meta['world_size'] // world_size})"
                    if not old_b * meta["world_size"] % world_size
                    else ")"
                )
            )
    if diffs:
        raise CheckpointError(f"checkpoint {path} was written by a different config: {', '.join(diffs)}")


def _tasks(config: dict) -> list[str]:
    """``name:kind`` per task of a resolved config dict (``label:binary`` for the one-task form)."""
    schema = (config.get("data") or {}).get("schema") or {}
    labels = schema.get("labels") or {}
    return [f"{n}:{(t or {}).get('kind', 'binary')}" for n, t in labels.items()] or ["label:binary"]
