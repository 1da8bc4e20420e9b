"""``sharding.replica_groups`` / ``replica_sync_every``: the keys, what is refused before launch
(naming the key and the fix), and what ``recsys-dist plan`` shows: one sharding group's plan and
all-to-alls plus the replicas' sync (no processes; the multi-rank checks are
tests/ranks/distributed/test_replica_groups.py)."""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.dry_run import dry_run
from recsys_dist.train.preflight import check_before_launch
from tests.conftest import QUICKSTART, ROOT


def _job(*overrides, config=QUICKSTART, world=4):
    return resolve_job(load_config(config, ["distributed.device=cpu", *overrides]), world_size=world)


def test_defaults_and_sync_every_without_groups_is_an_error():
    s = load_config(QUICKSTART).sharding
    assert (s.replica_groups, s.replica_sync_every) == (1, 1)
    with pytest.raises(ConfigError, match="replica_sync_every: only read with replica_groups > 1"):
        load_config(QUICKSTART, ["sharding.replica_sync_every=4"])
    with pytest.raises(ConfigError, match="replica_groups"):
        load_config(QUICKSTART, ["sharding.replica_groups=0"])


@pytest.mark.parametrize(
    "overrides, world, words",
    [
        ((), 3, "sharding.replica_groups: 2 groups do not divide 3 rank"),
        (
            ("distributed.dense.strategy=pipeline", "distributed.dense.stages=4"),
            4,
            r"sharding.replica_groups: 2: distributed.dense.stages: 4 does not divide a sharding group's 2 rank\(s\) "
            r"\(4 ranks / 2 groups\): each pipeline runs inside one sharding group.*use distributed.dense.stages one "
            r"of \[2\]",
        ),
        (
            ("distributed.dense.strategy=pipeline", "distributed.dense.stages=2"),
            2,
            r"stages: 2 does not divide a sharding group's 1 rank\(s\).*use distributed.dense.strategy ddp or fsdp",
        ),
        (("train.embedding_optimizer=adam",), 4, "train.embedding_optimizer adam keeps state"),
        (("train.pipeline=semi_sync",), 4, "train.pipeline semi_sync looks up the next batch before"),
        (
            ("sharding.sharding_types=[row_wise, table_column_wise]",),
            4,
            r"sharding.sharding_types: \['table_column_wise'\]",
        ),
        (("sharding.per_table.t_C1.sharding_types=[table_row_wise]",), 4, "sharding.per_table.t_C1.sharding_types"),
    ],
)
def test_refused_before_launch_naming_the_key(overrides, world, words):
    job = _job("sharding.replica_groups=2", f"distributed.nproc_per_node={world}", *overrides, world=world)
    with pytest.raises(ConfigError, match=words):
        check_before_launch(job)


def test_managed_ids_are_refused():
    job = _job(
        "sharding.replica_groups=2", "distributed.nproc_per_node=4", config=ROOT / "configs" / "avazu_managed.yaml"
    )
    with pytest.raises(ConfigError, match="managed-collision ids"):
        check_before_launch(job)


def test_sequence_tables_are_accepted():
    """EmbeddingCollection tables are synced like pooled ones (tests/ranks/distributed/test_replica_groups.py)."""
    for config in ("movielens_bst.yaml", "movielens_hstu.yaml", "movielens_din.yaml"):
        check_before_launch(
            _job("sharding.replica_groups=2", "distributed.nproc_per_node=4", config=ROOT / "configs" / config)
        )


def test_fsdp_is_accepted_and_planned_over_the_job():
    """fsdp with replica groups: accepted; ``recsys-dist plan`` shows the tower sharded over all 4
    ranks of the job (1/4 each, as in one group of 4), and its all-gather / reduce-scatter chunks
    going to 3 peers, not to a sharding group's 1 (tests/ranks/distributed/test_replica_groups.py
    counts them at the collectives)."""
    fsdp = ("distributed.dense.strategy=fsdp", "distributed.nproc_per_node=4")
    check_before_launch(_job("sharding.replica_groups=2", *fsdp))
    flat = dry_run(_job(*fsdp), 4, 4, "cpu")
    two = dry_run(_job("sharding.replica_groups=2", *fsdp), 4, 4, "cpu")
    ddp = dry_run(_job("sharding.replica_groups=2", "distributed.nproc_per_node=4"), 4, 4, "cpu")
    assert two.ledger.world_size == 2 and len(two.dense["per_rank"]) == 4
    assert two.dense["per_rank"] == flat.dense["per_rank"]
    tower = ddp.dense["per_rank"][0]["parameters"]
    assert all(r["parameters"] <= tower / 4 * 1.05 for r in two.dense["per_rank"])
    for phase in ("fsdp_all_gather", "fsdp_reduce_scatter", "allreduce"):
        assert [r[phase] for r in two.ledger.per_rank()] == [r[phase] for r in flat.ledger.per_rank()[:2]], phase
    assert two.ledger.per_rank()[0]["fsdp_all_gather"]["sent"] > 0
    text = two.text()
    assert "over all 4 ranks of the job, across the 2 replica groups" in text and "fsdp gather" in text


def test_pipeline_is_accepted_and_planned_inside_each_group():
    """pipeline (2 stages) with 2 replica groups of 2 at 4 ranks: accepted (it was refused);
    ``recsys-dist plan`` lays each pipeline inside a sharding group (stage 0 on ranks 0 and 1,
    group rank 0 of each group; in one group of 4 on ranks 0 and 2), each rank holding its
    stage's bytes, and the ledger's rows (a group's ranks) book the pipeline's collectives of
    pipeline ranks 0 and 1 (those of one group's rows 0 and 1) and the stages' all-reduce over
    the 2 pipelines of the job. tests/ranks/distributed/test_replica_groups.py counts them."""
    pipe = ("distributed.dense.strategy=pipeline", "distributed.dense.stages=2", "distributed.nproc_per_node=4")
    check_before_launch(_job("sharding.replica_groups=2", *pipe))
    flat = dry_run(_job(*pipe), 4, 4, "cpu")
    two = dry_run(_job("sharding.replica_groups=2", *pipe), 4, 4, "cpu")
    assert [s["ranks"] for s in flat.dense["pipeline"]["stages"]] == [[0, 2], [1, 3]]
    assert [s["ranks"] for s in two.dense["pipeline"]["stages"]] == [[0, 1], [2, 3]]
    assert two.dense["pipeline"]["grid"] == flat.dense["pipeline"]["grid"] == {"dp": 2, "pp": 2}
    assert two.dense["pipeline"]["pipelines"] == [[0, 2], [1, 3]] and flat.dense["pipeline"]["pipelines"] == [
        [0, 1],
        [2, 3],
    ]
    assert "pipeline 0: ranks 0,2; pipeline 1: ranks 1,3" in two.text()
    f, t = flat.dense["per_rank"], two.dense["per_rank"]
    assert t == [f[0], f[0], f[1], f[1]] and f[0] != f[1]  # by stage: ranks 0, 1 hold stage 0 in groups
    assert two.ledger.world_size == 2
    for phase in ("pipeline_io", "pipeline_p2p", "allreduce"):
        assert [r[phase] for r in two.ledger.per_rank()] == [r[phase] for r in flat.ledger.per_rank()[:2]], phase
    assert two.ledger.per_rank()[0]["pipeline_p2p"]["sent"] > 0 and "pp p2p" in two.text()


def test_accepted_with_sgd_and_adagrads():
    for opt in ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad"):
        check_before_launch(
            _job("sharding.replica_groups=2", "distributed.nproc_per_node=4", f"train.embedding_optimizer={opt}")
        )


def test_dry_run_plans_one_group_and_adds_the_sync():
    """world 4 in 2 groups: the plan and all-to-alls of 2 ranks (those of a 2-rank job), and each
    rank's sync payload: its shards' fp32 weights and rowwise Adagrad's one float per row."""
    types = "sharding.sharding_types=[row_wise]"
    flat4 = dry_run(_job(types), 4, 4, "cpu")
    flat2 = dry_run(_job(types, world=2), 2, 2, "cpu")
    two = dry_run(_job(types, "sharding.replica_groups=2", "sharding.replica_sync_every=2"), 4, 4, "cpu")
    assert two.world_size == 2 and two.replica_groups == 2 and two.ledger.world_size == 2
    assert [p.ranks for p in two.placements] == [p.ranks for p in flat2.placements] == [[0, 1]] * len(two.placements)
    a2a = ("input_dist", "output_dist_forward", "output_dist_backward")
    for phase in a2a:
        assert two.ledger.totals()[phase] == pytest.approx(flat2.ledger.totals()[phase])
    # per rank: reduce-scatter over 2 ranks, not 4 (row_wise output_dist: (W - 1) chunks)
    per4, per2 = flat4.ledger.per_rank()[0], two.ledger.per_rank()[0]
    assert per2["output_dist_forward"]["sent"] * 3 == pytest.approx(per4["output_dist_forward"]["sent"])
    job = _job(types)
    dim, rows = (
        job.features.planned_tables()[0].embedding_dim,
        [t.num_embeddings for t in job.features.planned_tables()],
    )
    half = sum(-(-r // 2) for r in rows)  # rank 0's rows of every table (ceil), row_wise over 2
    assert two.ledger.sync_bytes[0] == half * (dim + 1) * 4
    assert two.ledger.per_rank()[0]["replica_sync"]["sent"] == two.ledger.sync_bytes[0] / 2
    text = two.text()
    assert "plan for one sharding group of 2 ranks" in text and "replica sync" in text
    assert "replica sync" not in flat4.text() and flat4.ledger.sync_bytes == []


def test_table_rules_are_those_of_one_group():
    """The rules that depend on the world size see one sharding group: a fixed plan's ranks, and
    fp16 comms on groups of one rank (nothing crosses a wire there)."""
    fixed = "sharding.fixed_plan={t_C1: {sharding_type: table_wise, ranks: [3]}}"
    job = _job("sharding.replica_groups=2", "distributed.nproc_per_node=4", fixed)
    # Named as a group's ranks: before, "but the job has 2 rank(s)" of a job of 4 ranks.
    want = (
        r"sharding.fixed_plan.t_C1.ranks: \[3\] but a sharding group has 2 rank\(s\), numbered 0 .. 1 within the "
        r"group \(sharding.replica_groups: 2 groups of the job's 4 ranks, each holding the same plan\)"
    )
    with pytest.raises(ConfigError, match=want):
        check_before_launch(job)
    job = _job("sharding.replica_groups=2", "distributed.nproc_per_node=2", fixed, world=2)
    with pytest.raises(
        ConfigError, match=r"\[3\] but a sharding group has 1 rank\(s\), numbered 0 .. 0 .*job's 2 ranks"
    ):
        check_before_launch(job)
    comms = ("sharding.comms.forward=fp16", "sharding.comms.backward=fp16")
    check_before_launch(_job("sharding.replica_groups=2", "distributed.nproc_per_node=4", *comms))
    # the group named (before: "a job of 1 rank" of a 2-rank job)
    with pytest.raises(ConfigError, match=r"sharding.comms: a sharding group of 1 rank \(sharding.replica_groups: 2 "):
        check_before_launch(_job("sharding.replica_groups=2", "distributed.nproc_per_node=2", *comms, world=2))
