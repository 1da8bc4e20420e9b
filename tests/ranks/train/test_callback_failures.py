"""A callback's ``on_validation_end``, ``on_step_end`` or ``on_partition_end`` raising on one rank
of 2: every rank raises (none waits in a collective), after a checkpoint of the step;
``resume="auto"`` ends with the uninterrupted run's numbers (a stream: every partition's rows
once). One rank in this process: tests/e2e/train/test_callback_failures.py."""

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
    resumed_lines, plain_lines, step_end_lines = ranks[0]["lines"]
    assert resumed_lines == plain_lines

    # on_step_end at step 4, a validation step, in a callback only rank 1 has. Before: rank 1
    # raised, rank 0 waited in the next collective until the process group's timeout.
    step_end = tmp_path / "step_end" / "checkpoints" / "step_00000004"
    kind, message, notes = ranks[1]["step_end"]["raised"]
    assert (kind, message) == ("ValueError", "rank 1's on_step_end at step 4")
    assert "raised by callback RaiseAtStepEnd.on_step_end at step 4 on rank(s) 1; every rank stopped" in notes[0]
    assert f"the run's state at step 4 is in checkpoint {step_end}" in notes[0]
    kind, message, _ = ranks[0]["step_end"]["raised"]
    assert kind == "RuntimeError" and message.startswith(
        "a callback failed on rank(s) 1 at step 4 (RaiseAtStepEnd.on_step_end raised ValueError: rank 1's"
    )
    for r in ranks:  # saved after the step's validation: the resumed run's lines are the plain run's
        assert r["step_end"]["resumed_at"] == 4 and r["step_end"]["resumed"] == ranks[0]["plain"]
    assert step_end_lines == plain_lines

    # on_partition_end on rank 1 after the stream's first partition (10 steps): its checkpoint
    # holds it; the resumed run trains the second; every row once.
    stream = [r["stream"] for r in ranks]
    kind, message, notes = stream[1]["raised"]
    assert (kind, message) == ("ValueError", "rank 1's on_partition_end after day=0/hour=00/part-0.txt")
    assert "RaiseAfterPartition.on_partition_end at step 10 on rank(s) 1; every rank stopped" in notes[0]
    assert "the run's state at step 10 is in checkpoint " in notes[0] and notes[0].count("step_00000010") == 1
    assert stream[0]["raised"][0] == "RuntimeError"
    assert [s["resumed_at"] for s in stream] == [10, 10]
    assert (
        stream[0]["partitions"] == stream[1]["partitions"] == ["day=0/hour=00/part-0.txt", "day=0/hour=01/part-0.txt"]
    )
    assert stream[0]["parts"] == [("day=0/hour=00/part-0.txt", 640), ("day=0/hour=01/part-0.txt", 640)]
