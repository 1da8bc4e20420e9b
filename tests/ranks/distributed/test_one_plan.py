"""One planning path: for the same config the Trainer's path (``shard_model``), the public
``recsys_dist.shard`` and the dry run (``recsys-dist plan``) give the same plan, per table:
sharding type, compute kernel, ranks, shard sizes and offsets; with and without a
``sharding.fixed_plan`` (the dry run ignored the fixed plan before it planned through
``distributed.plan.plan``). And the config schema loads no torch."""

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.testing import run_ranks
from recsys_dist.train.dry_run import dry_run
from tests.conftest import QUICKSTART
from tests.ranks.distributed.one_plan_worker import library_plans, plan_shape

# A hand placement of the 26 quickstart tables using every type a fixed plan takes.
PLACEMENTS = [
    "{sharding_type: table_wise, ranks: [1]}",
    "{sharding_type: column_wise, ranks: [1, 0]}",
    "{sharding_type: row_wise}",
    "{sharding_type: data_parallel}",
    "{sharding_type: table_row_wise, ranks: [0, 1]}",
    "{sharding_type: table_wise, ranks: [0]}",
]
FIXED = "sharding.fixed_plan={" + ", ".join(f"t_C{i}: {PLACEMENTS[i % 6]}" for i in range(1, 27)) + "}"
CASES = {"planner": [], "fixed_plan": [FIXED]}


def test_trainer_shard_and_dry_run_give_the_same_plan():
    per_rank = run_ranks(library_plans, 2, list(CASES.values()))
    for i, (case, extra) in enumerate(CASES.items()):
        report = dry_run(resolve_job(load_config(QUICKSTART, ["distributed.device=cpu", *extra])), 2, 2, "cpu")
        want = plan_shape(report.plan)
        assert len(want) == 26, case
        for rank, results in enumerate(per_rank):
            assert results[i]["trainer"] == want, (case, rank, "trainer")
            assert results[i]["shard"] == want, (case, rank, "shard")
        if case == "fixed_plan":  # the placements asked for, not a planner's
            assert {t: v[0] for t, v in want.items()} == {
                f"t_C{i}": PLACEMENTS[i % 6].split(",")[0].split(": ")[1].rstrip("}") for i in range(1, 27)
            }
