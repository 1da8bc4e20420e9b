"""MMoE (Ma et al., KDD 2018): eq. 5-7 against a plain loop; one logit per task; sharded."""

import pytest

from tests.unit.models.test_mmoe import CONFIG


@pytest.mark.slow
def test_mmoe_and_ple_sharded_equal_unsharded_on_3_ranks():
    # 3 ranks (a row-wise table splits 3 ways); 2 ranks and training at 1/2/3 ranks are
    # covered by tests/e2e/models/test_multitask_cli.py and tests/ranks/train/test_padded_batches.py.
    from recsys_dist.testing import run_ranks
    from tests.ranks.models import mmoe_worker
    from tests.unit.models.test_ple import CONFIG as PLE_CONFIG

    for diffs in run_ranks(mmoe_worker.both_models, 3, str(CONFIG), str(PLE_CONFIG)):
        for diff in diffs:
            assert diff <= 1e-5, diffs
