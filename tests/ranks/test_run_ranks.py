"""recsys_dist.testing.run_ranks when a rank dies without reporting."""

import os

import pytest

from recsys_dist.testing import run_ranks


def _die_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)  # no traceback, no result: as a rank killed by the OOM killer
    return rank


@pytest.mark.slow
def test_a_rank_that_dies_without_a_result_is_reported_not_waited_for():
    # it waited out the whole timeout_s ("no result within ...") before
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] died without a result \(exit codes \[3\]\)"):
        run_ranks(_die_on_rank_1, 2, timeout_s=120)
