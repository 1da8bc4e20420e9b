"""Issue 17 item 4: a table too small to give every rank a row is never sharded row-wise.

TorchRec cuts row-wise shards of ceil(rows / ranks) rows, so 4 rows on 3 ranks are 2, 2, 0 and
FBGEMM fails on the empty shard (before: ~140 traceback lines). The planner is not offered
row_wise for such a table; a config that leaves it nothing else is refused before any rank
starts, naming the table and the fix.
"""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from recsys_dist.distributed.plan import World, plan, table_constraints
from recsys_dist.distributed.rules import leaves_rank_empty
from tests.conftest import QUICKSTART


def test_which_row_wise_shardings_leave_a_rank_empty():
    assert leaves_rank_empty(4, 3) and leaves_rank_empty(2, 3) and leaves_rank_empty(5, 4)
    assert not leaves_rank_empty(1000, 3) and not leaves_rank_empty(3, 3) and not leaves_rank_empty(2, 1)
    assert not leaves_rank_empty(7, 3)  # 3, 3, 1


def test_small_tables_are_not_offered_row_wise():
    import torch

    from recsys_dist.config.job import resolve_job
    from recsys_dist.models.build import build_model

    job = resolve_job(
        load_config(QUICKSTART, ["data.num_embeddings=4", "sharding.sharding_types=[row_wise,table_wise]"])
    )
    tables, s = job.features.planned_tables(), job.sharding
    assert {tuple(c.sharding_types) for c in table_constraints(s, tables).values()} == {("row_wise", "table_wise")}
    three, two = World(3, 3, "cpu"), World(2, 2, "cpu")
    assert {tuple(c.sharding_types) for c in table_constraints(s, tables, three).values()} == {("table_wise",)}
    assert {tuple(c.sharding_types) for c in table_constraints(s, tables, two).values()} == {("row_wise", "table_wise")}
    only_rw = resolve_job(load_config(QUICKSTART, ["data.num_embeddings=4", "sharding.sharding_types=[row_wise]"]))
    model = build_model(only_rw.model, only_rw.features.on(torch.device("meta")), only_rw.train)
    with pytest.raises(ConfigError, match="t_C1 .4 rows.*per_table.t_C1.sharding_types"):
        plan(model, only_rw.sharding, three, 64, config_error=True)
