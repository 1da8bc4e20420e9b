"""Issue 38 item 3: ``distributed.dense.schedule: 2bw`` is PipeDream-2BW's update rule
(W(t+1) = W(t) - lr * grad f(W(t-1)), the tables undelayed), checked against an independent
single-process reference on the unsharded model (two_bw_worker.reference_losses), with plain
SGD and with Adagrad on the tower; it differs from 1f1b (the delay is real); and its
checkpoints hold W(t-1), so a resumed 2bw run goes on with the same losses, and move to and
from ddp (the current weights).
"""

import pytest

from recsys_dist.testing import run_ranks
from tests.ranks.distributed import two_bw_worker

STEPS = 20
TOL = 1e-6
TWO_RANKS = [
    ("dcnv2", ["row_wise"], ("distributed.dense.microbatches=4",), ("sgd", 0.1)),
    ("dlrm", ["table_wise"], ("distributed.dense.microbatches=2",), ("adagrad", 0.05)),
]
FOUR_RANKS = [
    ("dcnv2", ["row_wise"], ("distributed.dense.stages=2", "distributed.dense.microbatches=4"), ("adagrad", 0.05))
]


def _rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def _check(results: list[dict]) -> None:
    for case, got in results[0].items():
        assert len(got["2bw"]) == STEPS and len(set(got["2bw"])) > STEPS - 3, case  # it trains
        assert max(_rel(got["2bw"], got["ref_2bw"])) <= TOL, (case, got["2bw"], got["ref_2bw"])
        # 1f1b is the synchronous rule (ddp's); 2bw equals it at step 0 (W(-1) = W(0)) and no later
        assert max(_rel(got["1f1b"], got["ref_sync"])) <= TOL, case
        diff = _rel(got["2bw"], got["1f1b"])
        assert diff[0] <= TOL and min(diff[1:]) > 10 * TOL and max(diff) > 1e-3, (case, diff)
        for r in results:  # every rank logs the same global loss
            assert r[case]["2bw"] == got["2bw"]
        for r in results:  # W(t-1) is one more copy of the rank's own stage, no more
            assert r[case]["bytes"]["stale"] == r[case]["bytes"]["stage"] > 0, r[case]["bytes"]


def test_2bw_is_the_one_step_stale_rule_at_two_ranks():
    _check(run_ranks(two_bw_worker.against_reference, 2, TWO_RANKS, STEPS, timeout_s=600))


@pytest.mark.slow
def test_2bw_is_the_one_step_stale_rule_at_two_pipelines_of_two_stages():
    _check(run_ranks(two_bw_worker.against_reference, 4, FOUR_RANKS, STEPS, timeout_s=900))


def test_2bw_checkpoints_resume_exactly_and_move_to_and_from_ddp(tmp_path):
    for r in run_ranks(two_bw_worker.resume, 2, str(tmp_path), 4, timeout_s=600):
        assert max(_rel(r["2bw<-2bw"], r["want_2bw"])) <= TOL, r  # W(t-1) restored: the same losses
        # without W(t-1) the first step runs on W(t): not the run's loss (the version is what made it)
        assert _rel(r["2bw<-2bw-nostale"], r["want_2bw"])[0] > 1e-4, r
        # from ddp: W(-1) = the loaded W(t): ddp's next loss first, then the delay shows
        assert _rel(r["2bw<-ddp"], r["want_ddp"])[0] <= TOL and _rel(r["2bw<-ddp"], r["want_ddp"])[1] > 1e-4, r
        # to ddp: the current weights, exactly; and the first loss is theirs: 2bw's fresh start's from ddp's side
        assert r["weights"] == 0.0, r
        assert _rel(r["2bw<-2bw-nostale"][:1], r["ddp<-2bw"][:1])[0] <= TOL, r
