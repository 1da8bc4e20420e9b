"""Callbacks raising on every rank at once under ``distributed.dense.strategy: pipeline`` (2 ranks,
2 stages): each rank raises its own exception, noted with every failing rank and the checkpoint
of the step (no rank waits in a stage's collective); the resumed runs end with the plain run's
numbers. (One rank failing, under ddp: test_callback_failures.py.)"""

import pytest

from recsys_dist.testing import run_ranks
from tests.ranks.train.pipeline_callback_worker import raise_on_every_rank


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_callbacks_raising_on_every_rank_under_pipeline_stop_all_after_saving(tmp_path):
    ranks = run_ranks(raise_on_every_rank, 2, str(tmp_path / "cache"), str(tmp_path), timeout_s=800, pg_timeout_s=120)
    for rank, got in enumerate(ranks):
        kind, message, notes = got["validation"]
        assert (kind, message) == ("ValueError", f"rank {rank}'s on_validation_end")
        checkpoint = tmp_path / "validation" / "checkpoints" / "step_00000008"
        assert notes == [
            "recsys_dist: raised by callback RaiseAtValidation.on_validation_end at step 8 on rank(s) 0, 1; every "
            f"rank stopped; the run's state at step 8 is in checkpoint {checkpoint}: continue with resume='auto' "
            "(--resume auto)"
        ]
        kind, message, notes = got["step"]
        assert (kind, message) == ("KeyError", repr(f"rank {rank}'s on_step_end"))
        assert "RaiseAtStep.on_step_end at step 6 on rank(s) 0, 1; every rank stopped" in notes[0]
        assert str(tmp_path / "step" / "checkpoints" / "step_00000006") in notes[0]
        assert got["validation_resumed"] == (8, ranks[0]["plain"])
        assert got["step_resumed"] == (6, ranks[0]["plain"])
        assert got["plain"] == ranks[0]["plain"]
