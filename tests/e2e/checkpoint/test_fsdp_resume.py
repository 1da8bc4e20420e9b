"""Checkpoints across dense layouts and world sizes (issue 38 item 5): a run stopped under one
``distributed.dense.strategy`` resumes under the other at another world size, and its following
losses equal an uninterrupted run's. Global batch 96 at every world size (tests.e2e.checkpoint.test_resume),
so the uninterrupted run's losses hold for any layout within 1e-5 (float32 reduction order)."""

import pytest

from tests.cli import read_metrics
from tests.e2e.checkpoint.test_resume import WS, assert_same_losses, losses, train

STOP = ["train.max_steps=10", "checkpoint.every_n_steps=4"]


def _strategy(s: str) -> str:
    return f"distributed.dense.strategy={s}"


@pytest.mark.slow
@pytest.mark.timeout(1500)  # five runs of 2-3 ranks
def test_checkpoints_move_between_ddp_and_fsdp_at_other_world_sizes(tmp_path):
    ref = tmp_path / "ref"
    r = train(tmp_path, ref, *WS[2], _strategy("ddp"))
    assert r.returncode == 0, r.stderr[-2000:]
    for name, (ws, first), (ws2, then) in (
        ("ddp2_fsdp3", (2, "ddp"), (3, "fsdp")),
        ("fsdp3_ddp1", (3, "fsdp"), (1, "ddp")),
    ):
        run = tmp_path / name
        r = train(tmp_path, run, *WS[ws], _strategy(first), *STOP)
        assert r.returncode == 0, r.stderr[-2000:]
        stopped = losses(run)
        assert max(stopped) == 10 and all(abs(stopped[s] - losses(ref)[s]) <= 1e-5 for s in stopped), name
        r = train(tmp_path, run, "--resume", "auto", *WS[ws2], _strategy(then))
        assert r.returncode == 0, r.stderr[-2000:]
        assert_same_losses(ref, run, 1e-5)
        # the resume ran the new layout: its ledger line (written again when a resume changes it)
        ledger = read_metrics(run, "ledger")[-1]
        gathered = sum(row["fsdp_all_gather"]["sent"] for row in ledger["per_rank"])
        assert ledger["world_size"] == ws2 and (gathered > 0) == (then == "fsdp" and ws2 > 1), ledger
