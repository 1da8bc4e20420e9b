"""Issue 17 item 4: a table too small to give every rank a row is never sharded row-wise.

TorchRec cuts row-wise shards of ceil(rows / ranks) rows, so 4 rows on 3 ranks are 2, 2, 0 and
FBGEMM fails on the empty shard (before: ~140 traceback lines). The planner is not offered
row_wise for such a table; a config that leaves it nothing else is refused before any rank
starts, naming the table and the fix.
"""

import json

from tests.cli import run_cli, run_train
from tests.conftest import QUICKSTART


def test_row_wise_only_on_too_few_rows_is_refused_before_start(tmp_path):
    r = run_train(
        QUICKSTART,
        tmp_path / "run",
        "data.num_embeddings=2",
        "distributed.nproc_per_node=3",
        "sharding.sharding_types=[row_wise]",
        tmp=tmp_path,
        inprocess=True,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "sharding.sharding_types" in r.stderr and "t_C1 (2 rows)" in r.stderr and "table_wise" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_plan_never_places_a_small_table_row_wise(tmp_path):
    r = run_cli(
        [
            "plan",
            "--config",
            str(QUICKSTART),
            "--world-size",
            "3",
            "--device",
            "cpu",
            "--json",
            "data.num_embeddings=4",
            "sharding.sharding_types=[row_wise,table_wise]",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    types = {p["sharding_type"] for p in json.loads(r.stdout)["placements"]}
    assert types == {"table_wise"}
