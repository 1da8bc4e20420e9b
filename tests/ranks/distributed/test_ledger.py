"""The bytes ledger: predicted from the plan (recsys_dist.distributed.ledger) == counted at the collectives
of a real step (recsys_dist.distributed.comm_counter), per rank and phase, exactly.

One spawn per world size runs table-wise, row-wise, column-wise (two shards on one rank
too), data-parallel, table-row-wise (one node) and a mixed plan, each with fp32 and fp16 output_dist comms
(sharding.comms), and checks that fp16 halves output_dist's bytes; and the table-wise plan behind
managed-collision tables (their per-step id all_gathers, managed_all_gather).
"""

import pytest

from recsys_dist.distributed.ledger import PHASES
from recsys_dist.testing import run_ranks
from tests.ranks.distributed import ledger_worker

PRECISIONS = [("fp32", "fp32"), ("fp16", "fp16"), ("fp16", "fp32")]


@pytest.mark.slow
@pytest.mark.timeout(600)  # 18 sharded models in one spawn; about 4 minutes on a loaded 2-core machine
@pytest.mark.parametrize("world_size", [2, 3])
def test_predicted_bytes_equal_counted_bytes(world_size):
    results = run_ranks(ledger_worker.count, world_size, PRECISIONS, timeout_s=900)
    failures = []
    for rank, per_case in enumerate(results):
        assert set(per_case) == {(p, f, b) for p in ledger_worker.plans(world_size) for f, b in PRECISIONS} | {
            ("table_wise+managed", "fp32", "fp32")
        }
        for case, d in per_case.items():
            pred, counted = d["predicted"], d["counted"]
            for phase in PHASES:
                if pred[phase] != counted[phase]:
                    failures.append(f"rank {rank} {case} {phase}: predicted {pred[phase]}, counted {counted[phase]}")
            if counted["other"] != {"sent": 0, "received": 0}:
                failures.append(f"rank {rank} {case}: uncounted collectives {counted['other']}")
        for plan in ledger_worker.plans(world_size):
            fp32 = per_case[(plan, "fp32", "fp32")]["counted"]
            fp16 = per_case[(plan, "fp16", "fp16")]["counted"]
            mixed = per_case[(plan, "fp16", "fp32")]["counted"]
            for phase in ("output_dist_forward", "output_dist_backward"):
                for k in ("sent", "received"):
                    assert fp16[phase][k] * 2 == fp32[phase][k], (rank, plan, phase, k)
            assert mixed["output_dist_forward"]["sent"] * 2 == fp32["output_dist_forward"]["sent"]
            assert mixed["output_dist_backward"] == fp32["output_dist_backward"]
            for phase in ("input_dist", "allreduce"):
                assert fp16[phase] == fp32[phase], (rank, plan, phase)
    assert not failures, "\n".join(failures)
    # every plan moves something, so the equalities above are not 0 == 0
    by_plan = {p: results[0][(p, "fp32", "fp32")]["counted"] for p in ledger_worker.plans(world_size)}
    assert all(
        by_plan[p]["output_dist_forward"]["sent"] + by_plan[p]["output_dist_forward"]["received"] > 0
        for p in ("table_wise", "row_wise", "column_wise")
    )
    assert by_plan["data_parallel"]["allreduce"]["sent"] > by_plan["table_wise"]["allreduce"]["sent"]
    # managed tables add their all_gathers and change nothing else on the wire
    managed = results[0][("table_wise+managed", "fp32", "fp32")]["counted"]
    assert managed["managed_all_gather"]["sent"] > 0 and by_plan["table_wise"]["managed_all_gather"]["sent"] == 0
    assert all(managed[p] == by_plan["table_wise"][p] for p in PHASES if p != "managed_all_gather")


@pytest.mark.slow
def test_injected_delay_keeps_collectives_correct():
    # TorchRec waits only on a dist.Work: a delayed collective must stay one, with its data.
    results = run_ranks(ledger_worker.delayed_all_to_all, 2, 200.0, timeout_s=120)
    for rank, got in enumerate(results):
        assert got["is_work"]
        assert got["out"] == got["futured"] == [2.0 * rank, 2.0 * rank + 1, 10 + 2.0 * rank, 11 + 2.0 * rank]
    # The delay counts from when the data arrived (rank 1 came 0.3 s late), not from rank 0's
    # own issue, where the wait for the late rank would absorb it; futures (DDP's hook) too.
    first = results[0]
    assert first["waited_late"] >= first["late_s"] + 0.2 - 0.02
    assert all(got["waited_future"] >= 0.2 - 0.005 for got in results)
    # exposed: the time inside wait(), booked to the phase (no TorchRec frame here: "other")
    for got in results:
        assert got["waited"] - 0.01 <= got["exposed"] <= got["waited"] + 1e-6
