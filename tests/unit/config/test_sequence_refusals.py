"""Config refusals found by adversarial testing: managed + sequence, sequence features on a model
that reads none, per_table naming of sequence tables."""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.preflight import check_before_launch, check_sections, table_names
from tests.conftest import ROOT

DIN = ROOT / "configs" / "movielens_din.yaml"
HSTU = ROOT / "configs" / "movielens_hstu.yaml"


@pytest.mark.parametrize("config", [DIN, HSTU], ids=["din", "hstu"])
def test_managed_with_sequence_features_is_refused(config):
    with pytest.raises(ConfigError) as e:
        load_config(config, ["data.categorical_mapping=managed", "data.managed={eviction_interval: 1}"])
    msg = str(e.value)
    assert "data.categorical_mapping" in msg and "data.schema.history" in msg and "not supported" in msg


def test_model_without_sequences_refuses_sequence_features():
    with pytest.raises(ConfigError) as e:
        check_sections(resolve_job(load_config(DIN, ["model={name: dcnv2}"])))  # preflight's cross-section pass
    msg = str(e.value)
    assert "model.name: dcnv2" in msg and "data.schema.history" in msg


def test_per_table_names_a_sequence_table_like_the_model():
    job = resolve_job(load_config(DIN, ["sharding.per_table={s_history: {sharding_types: [row_wise]}}"]))
    assert "s_history" in table_names(job) and "t_history" not in table_names(job)
    check_before_launch(job)  # accepted: the model's name for the table
    bad = load_config(DIN, ["sharding.per_table={t_history: {sharding_types: [row_wise]}}"])
    with pytest.raises(ConfigError, match="t_history"):
        check_before_launch(resolve_job(bad))
