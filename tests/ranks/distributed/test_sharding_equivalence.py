"""Every sharding type, sharded vs an unsharded reference, at world sizes 1, 2 and 3.

Three tables: 1000 rows x 8 (sum, multi-hot bags of 0-3 ids, so empty bags too; 1000 rows
do not split evenly over 3 ranks), 50 x 8 (mean pooling, 0-4 ids), 31 x 12 (one-hot).
Each case trains 3 steps; forward logits and loss at every step, and every embedding and
dense weight after the last step, must match the reference within 1e-6 absolute
(float32; measured worst case 2.4e-7). One spawn per world size serves all cases.
"""

import pytest

from recsys_dist.distributed.config import SHARDING_TYPES
from recsys_dist.testing import run_ranks
from tests.ranks.distributed import equivalence

TYPES = SHARDING_TYPES
# FBGEMM's CPU kernels have no Adam; Adam is covered on replicated (data-parallel) tables.
CASES = [(t, o) for t in TYPES for o in ("exact_sgd", "exact_rowwise_adagrad", "exact_adagrad")]
CASES.append(("data_parallel", "adam"))
TOL = 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_sharding_type_matches_unsharded(world_size):
    results = run_ranks(equivalence.check_all, world_size, CASES, timeout_s=600)
    failures = []
    for rank, per_case in enumerate(results):
        for case, diffs in per_case.items():
            bad = {k: v for k, v in diffs.items() if not v <= TOL}
            if bad:
                failures.append(f"rank {rank} {case}: {bad}")
    assert not failures, "\n".join(failures)
