"""Issue 38 item 6: HSTU (``model.name: hstu``) under ``distributed.dense.strategy: pipeline``
trains as ``ddp`` does at 2 ranks: its layers and head cut into stages
(``recsys_dist.models.zoo.hstu_stages``), the histories padded to their max length in one row
per example. One spawn serves every case; each trains 20 steps of both strategies from one seed
(plain SGD, one step where the last rank's batch is padding only, every history empty): global
losses within 1e-5 relative at every step, tables 1e-5, dense tensors 1e-3 of their update."""

from recsys_dist.testing import run_ranks
from tests.ranks.distributed import hstu_pipeline_worker

TOL = 1e-5
CASES = [
    # the shipped config's action tokens; 1f1b, 2 stages, 4 microbatches of 3 rows
    ("distributed.dense.schedule=1f1b", "distributed.dense.microbatches=4"),
    # the time bias (times of up to ~3 years in seconds: past 2^24, so both packed columns carry),
    # the chunked kernel, an explicit cut between the two layers
    (
        "data.schema.history.times=true",
        "model.time_buckets=128",
        "model.attention=chunked",
        "distributed.dense.schedule=1f1b",
        "distributed.dense.microbatches=2",
        "distributed.dense.split=[2]",
    ),
    # 4 stages on 2 ranks, interleaved
    ("distributed.dense.schedule=interleaved_1f1b", "distributed.dense.microbatches=4"),
]
# rank -> the tower modules of its stages, per case (the tower: target action, 2 layers, the
# head's 2 hidden layers, its output layer): split auto cuts after the head's first layer; the
# interleaved schedule's 4 stages [0, 3, 4, 5], stages 0 and 2 on rank 0, 1 and 3 on rank 1
A, L, H = "TargetAction", "LayerStage", "Head"
OWNED = {
    0: [[A, L, L, H], [A, L], [A, L, L, "Sequential"]],
    1: [["Sequential", "Linear"], [L, H, "Sequential", "Linear"], [H, "Linear"]],
}


def test_hstu_under_pipeline_equals_ddp_at_two_ranks():
    results = run_ranks(hstu_pipeline_worker.losses_and_weights, 2, CASES, 20, timeout_s=600)
    failures = []
    for rank, per_case in enumerate(results):
        assert list(per_case) == CASES
        for i, (case, got) in enumerate(per_case.items()):
            ddp, pipe = got["ddp"], got["pipeline"]
            assert len(pipe) == 20 and len(set(pipe)) > 15, (case, pipe)  # it trains
            rel = max(abs(a - b) / abs(b) for a, b in zip(pipe, ddp, strict=True))
            if not rel <= TOL:
                failures.append(f"rank {rank} {case}: loss rel diff {rel:.3g}")
            if not got["table_diff"] <= TOL:
                failures.append(f"rank {rank} {case}: table weights differ by {got['table_diff']:.3g}")
            if not got["dense_rel"] <= 1e-3:
                failures.append(f"rank {rank} {case}: dense weights differ by {got['dense_rel']:.3g} of their update")
            if got["owned"] != OWNED[rank][i]:
                failures.append(f"rank {rank} {case}: stages {got['starts']}, modules {got['owned']}")
    assert not failures, "\n".join(failures)
