"""Config refusals found by adversarial testing (and managed sequence tables, once refused), sequence features on a model
that reads none, per_table naming of sequence tables."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.build import managed_remap
from recsys_dist.train.preflight import check_before_launch, check_sections, table_names
from tests.conftest import ROOT

DIN = ROOT / "configs" / "movielens_din.yaml"
HSTU = ROOT / "configs" / "movielens_hstu.yaml"


@pytest.mark.parametrize("config", [DIN, HSTU], ids=["din", "hstu"])
def test_managed_sequence_tables_get_a_remap_module(config):
    """categorical_mapping: managed maps the history's ids too (before, refused: its raw ids
    would have reached s_history unmapped); a remap module per sequence feature, its rows the
    s_<feature> table's, its history one step's ids at least (max_length per row)."""
    job = resolve_job(load_config(config, ["data.categorical_mapping=managed", "data.managed={eviction_interval: 3}"]))
    seq = job.features.sequence_names
    assert "history" in seq and set(seq) <= set(job.features.managed)
    remap = managed_remap(job, job.features.on(torch.device("cpu")))
    rows = {t.feature_names[0]: t.num_embeddings for t in job.features.sequence_tables}
    for f in seq:
        assert remap.mch[f]._zch_size == rows[f]
        assert (
            remap.mch[f]._hist_ids.numel() == 3 * job.train.batch_size * 2 * 50
        )  # interval x global batch x max_length
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=job.features.keys,
        values=torch.arange(1, 1 + 4 * len(job.features.keys), dtype=torch.int64) << 40,  # raw 63-bit-range ids
        lengths=torch.full((2 * len(job.features.keys),), 2, dtype=torch.int32),
    )
    out = remap.eval()(kjt)
    for f in seq:
        assert out[f].values().tolist() == [rows[f] - 1] * 4  # not admitted yet: the default row


def test_a_sequence_feature_in_managed_features_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(HSTU, ["data.managed={features: [history], eviction_interval: 1}"])
    assert "data.managed.features: history" in str(e.value) and "categorical_mapping: managed" in str(e.value)


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
