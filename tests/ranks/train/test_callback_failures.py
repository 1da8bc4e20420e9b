"""A callback's ``on_validation_end`` raising on one rank of 2: every rank raises (none waits in
a collective), after a checkpoint of the step; ``resume="auto"`` ends with the uninterrupted
run's numbers. One rank in this process: tests/e2e/train/test_callback_failures.py."""

import pytest

from recsys_dist.testing import run_ranks
from tests.ranks.train.callback_failure_worker import raise_on_one_rank


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_callback_raising_on_one_rank_stops_every_rank_after_saving_the_step(tmp_path):
    ranks = run_ranks(raise_on_one_rank, 2, str(tmp_path / "cache"), str(tmp_path), timeout_s=800, pg_timeout_s=120)
    checkpoint = tmp_path / "raised" / "checkpoints" / "step_00000008"
    kind, message, notes = ranks[1]["raised"]  # the rank whose callback raised: its exception, noted
    assert (kind, message) == ("ValueError", "rank 1's callback at step 8")
    assert "raised by callback RaiseOnRank.on_validation_end at step 8 on rank(s) 1; every rank stopped" in notes[0]
    assert f"the run's state at step 8 is in checkpoint {checkpoint}" in notes[0]
    kind, message, _ = ranks[0]["raised"]  # the other: a RuntimeError naming it (before: it trained on)
    assert kind == "RuntimeError"
    assert message.startswith(
        "a callback failed on rank(s) 1 at step 8 (RaiseOnRank.on_validation_end raised ValueError: "
        "rank 1's callback at step 8); every rank stopped; the run's state at step 8 is in checkpoint "
    )
    for r in ranks:
        assert r["resumed_at"] == 8 and r["resumed"] == r["plain"] == ranks[0]["plain"]
    resumed_lines, plain_lines = ranks[0]["lines"]
    assert resumed_lines == plain_lines
