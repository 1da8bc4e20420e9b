"""Every model: output shape, gradient flow to every parameter, sharded == unsharded."""

import pytest

from recsys_dist.testing import run_ranks
from tests.ranks.distributed import equivalence
from tests.unit.models.test_models import MODELS


@pytest.mark.slow
def test_every_model_sharded_equals_unsharded():
    names = [*MODELS, "two_tower"]
    for per_model in run_ranks(equivalence.models_sharded_vs_unsharded, 2, names):
        assert per_model.keys() == set(names)
        for name, diff in per_model.items():
            assert diff <= 1e-5, (name, diff)
