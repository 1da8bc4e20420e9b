"""The public builders refuse what they cannot build from: ``recsys_dist.feature_spec(cfg, sizes)``
(and ``resolve_job(cfg, sizes=...)``) with sizes that do not give every feature one table of at
least 2 rows, and ``recsys_dist.build_model`` given the root config for a section."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import recsys_dist
from tests.cli import ROOT

QUICKSTART = ROOT / "configs" / "criteo_quickstart.yaml"


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        # before: cut to the first 26 by zip, the 27th ignored (a model over other sizes than meant)
        ([10] * 26 + [5], r"num_embeddings: 27 table sizes for 26 categorical features \(C1, C2"),
        ([10, 20], r"num_embeddings: 2 table sizes for 26 categorical features"),
        # before: accepted, a table of 0 rows / 1.5 rows failed later, deep in torch
        ([10] * 25 + [0], r"num_embeddings: table sizes must be ints >= 2 .*got C26: 0$"),
        ([1.5] * 26, r"got C1: 1.5, C2: 1.5"),
        (26, r"num_embeddings: expected a list of 26 table sizes, got 26"),
    ],
)
def test_feature_spec_refuses_sizes_that_do_not_fit_the_features(sizes, message):
    cfg = recsys_dist.load_config(QUICKSTART)
    with pytest.raises(ValueError, match=message):
        recsys_dist.feature_spec(cfg, sizes)
    with pytest.raises(ValueError, match=message):
        recsys_dist.resolve_job(cfg, sizes=sizes)


def test_feature_spec_takes_a_conversions_numpy_sizes():
    cfg = recsys_dist.load_config(QUICKSTART)
    spec = recsys_dist.feature_spec(cfg, np.arange(2, 28, dtype=np.int64))
    assert spec.num_embeddings == list(range(2, 28)) and all(type(n) is int for n in spec.num_embeddings)


def test_build_model_names_the_argument_given_the_root_config():
    """Before: ``AttributeError: 'RunConfig' object has no attribute 'name'`` (or ``precision``)."""
    cfg = recsys_dist.load_config(QUICKSTART)
    job = recsys_dist.resolve_job(cfg)
    features = job.features.on(torch.device("cpu"))
    with pytest.raises(TypeError, match=r"model_cfg must be a ModelConfig, got RunConfig; call build_model\(job.model"):
        recsys_dist.build_model(cfg, features)
    with pytest.raises(TypeError, match=r"train_cfg must be the train section \(job.train\), got RunConfig"):
        recsys_dist.build_model(job.model, features, cfg)
    with pytest.raises(TypeError, match=r"features must be a FeatureSpec, got RunConfig"):
        recsys_dist.build_model(job.model, cfg)
    assert isinstance(recsys_dist.build_model(job.model, features, job.train), torch.nn.Module)
