"""A pipeline rank holds only its own stages (docs/design/pipeline.md): scoring runs through the
stages (each rank's rows, whatever their count), the whole state gathers to rank 0 from the ranks
holding each part, and a freed weight cannot be used by mistake (a plain meta tensor could:
``cpu @ meta.T`` gives uninitialised memory without an error in torch 2.13)."""

from recsys_dist.testing import run_ranks
from tests.ranks.distributed.stage_scoring_worker import score_gather_and_use


def test_scoring_gathering_and_a_freed_weight_on_two_ranks():
    r0, r1 = run_ranks(score_gather_and_use, 2, timeout_s=300)
    # loop placement: rank 0 stages 0 and 2, rank 1 stages 1 and 3
    assert r0["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert r1["keys"] == ["1.bias", "1.weight", "3.bias", "3.weight"]
    assert (r0["parameters"], r1["parameters"]) == (4 * 6 + 6 + 5 * 3 + 3, 6 * 5 + 5 + 3 * 1 + 1)
    assert r0["score_diff"] < 1e-6 and r1["score_diff"] < 1e-6, (r0, r1)
    assert r0["gathered"] is True
    assert r0["estimate"] == r1["estimate"] == r0["whole_bytes"], (r0, r1)
    for r, freed in ((r0, "1.weight"), (r1, "0.weight")):
        assert r["use"].startswith(f"distributed.dense.strategy: pipeline: {freed} belongs to a stage another rank"), r
