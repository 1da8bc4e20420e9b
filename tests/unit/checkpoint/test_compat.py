"""Resume compatibility: settings that change what the ids mean (categorical_mapping, managed
tables, sequence features) and, under managed tables, the global batch are refused before launch."""

from pathlib import Path

import pytest

from recsys_dist.checkpoint.compat import check_compatible
from recsys_dist.config.loader import load_config
from recsys_dist.errors import CheckpointError
from tests.conftest import QUICKSTART, ROOT

MANAGED = ["data.categorical_mapping=managed", "data.managed={eviction_interval: 1}"]
CKPT = Path("ckpt")


def meta_of(cfg, world_size=2):
    return {"config": cfg.to_dict(), "world_size": world_size, "step": 1}


def refusal(old, new, world_size=2, saved_world=2):
    with pytest.raises(CheckpointError) as e:
        check_compatible(CKPT, meta_of(old, saved_world), new.to_dict(), tables=False, world_size=world_size)
    return str(e.value)


def test_managed_resume_refuses_another_mapping_or_policy():
    old = load_config(QUICKSTART, MANAGED)
    msg = refusal(old, load_config(QUICKSTART))
    assert "data.categorical_mapping 'managed' -> 'hash'" in msg and "data.managed" in msg
    msg = refusal(
        old, load_config(QUICKSTART, ["data.categorical_mapping=managed", "data.managed={eviction_interval: 2}"])
    )
    assert "data.managed.eviction_interval 1 -> 2" in msg
    msg = refusal(old, load_config(QUICKSTART, [*MANAGED[:1], "data.managed={eviction_interval: 1, eviction: lru}"]))
    assert "data.managed.eviction" in msg
    check_compatible(CKPT, meta_of(old), load_config(QUICKSTART, MANAGED).to_dict(), tables=False, world_size=2)


def test_managed_resume_keeps_the_global_batch():
    old = load_config(QUICKSTART, MANAGED)
    b = old.train.batch_size
    msg = refusal(old, old, world_size=3, saved_world=2)
    assert "global batch" in msg and f"{b} x 2" in msg and f"{b} x 3" in msg
    # Same global batch on another world size: accepted.
    same = load_config(QUICKSTART, [*MANAGED, f"train.batch_size={b * 2}"])
    check_compatible(CKPT, meta_of(old, 2), same.to_dict(), tables=False, world_size=1)
    # Without managed tables the batch may change.
    plain = load_config(QUICKSTART)
    check_compatible(CKPT, meta_of(plain, 2), plain.to_dict(), tables=False, world_size=3)


def test_resume_refuses_changed_sequence_features():
    din = ROOT / "configs" / "movielens_din.yaml"
    old = load_config(din)
    msg = refusal(old, load_config(din, ["data.schema.history.max_length=5"]))
    assert "data.schema.history" in msg and "'max_length': 50" in msg and "'max_length': 5" in msg


def test_a_checkpoint_from_before_history_action_values_resumes():
    """``data.schema.history.action_values`` was added later: a checkpoint whose history lacks it
    resumes (its numbers are the default's); another value of a key it has is still refused."""
    hstu = ROOT / "configs" / "movielens_hstu.yaml"
    new = load_config(hstu)
    meta = meta_of(new)
    del meta["config"]["data"]["schema"]["history"]["action_values"]
    check_compatible(CKPT, meta, new.to_dict(), tables=False, world_size=2)
    with pytest.raises(CheckpointError, match="data.schema.history"):
        check_compatible(CKPT, meta, load_config(hstu, ["data.schema.history.max_length=3"]).to_dict(), tables=False)
