"""The bytes ledger of a dry-run plan, and the config checks of sharding.comms and train.pipeline
(no processes; the counted-vs-predicted check is tests/ranks/distributed/test_ledger.py)."""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.distributed.ledger import PHASES
from recsys_dist.train.dry_run import dry_run
from recsys_dist.train.preflight import check_before_launch
from tests.conftest import QUICKSTART, ROOT


def test_dry_run_ledger_balances_and_fp16_halves_output_dist():
    reports = {}
    for prec in ("fp32", "fp16"):
        cfg = load_config(
            QUICKSTART,
            [
                f"sharding.comms.forward={prec}",
                f"sharding.comms.backward={prec}",
                "train.batch_size=64",
                # one type, so the planner (whose cost model sees the comms precision) places alike
                "sharding.sharding_types=[row_wise]",
            ],
        )
        reports[prec] = dry_run(resolve_job(cfg), 3, 3, "cpu")
    led = reports["fp32"].ledger
    assert led.batch_size == 64 and led.world_size == 3
    rows = led.per_rank()
    # every byte sent by one rank is received by another
    for phase in ("input_dist", "output_dist_forward", "output_dist_backward"):
        assert sum(r[phase]["sent"] for r in rows) == pytest.approx(sum(r[phase]["received"] for r in rows))
    assert sum(led.totals()[p] for p in ("input_dist", "output_dist_forward")) > 0
    half = reports["fp16"].ledger.totals()
    for phase in PHASES:
        want = led.totals()[phase] / (2 if phase.startswith("output_dist") else 1)
        assert half[phase] == pytest.approx(want), phase
    assert "bytes per step on the wire" in reports["fp32"].text()


@pytest.mark.parametrize(
    "override, words",
    [
        ("sharding.comms.forward=bf16", "sharding.comms.forward: bf16 comms need CUDA"),
        ("sharding.comms.backward=bf16", "sharding.comms.backward: bf16 comms need CUDA"),
        ("train.pipeline=semi_sync", "train.pipeline: semi_sync needs CUDA"),
        ("train.pipeline=fused_sparse_dist", "train.pipeline: fused_sparse_dist needs CUDA"),
    ],
)
def test_cpu_refuses_what_it_cannot_run_before_any_rank_starts(override, words):
    cfg = load_config(QUICKSTART, [override, "distributed.device=cpu"])
    with pytest.raises(ConfigError, match=words):
        check_before_launch(resolve_job(cfg))


def test_cpu_accepts_fp16_comms_and_base_pipeline():
    cfg = load_config(QUICKSTART, ["sharding.comms.forward=fp16", "train.pipeline=base", "distributed.device=cpu"])
    check_before_launch(resolve_job(cfg))


def test_managed_tables_all_gathers_are_in_the_ledger():
    # configs/movielens_managed.yaml: 3 managed features (userId, movieId, genres), one id each
    # assumed; per rank and step: the 3 counts, then B x 3 ids, int64, to each of the W - 1 peers.
    cfg = load_config(ROOT / "configs" / "movielens_managed.yaml", ["train.batch_size=64"])
    report = dry_run(resolve_job(cfg), 3, 3, "cpu")
    want = 8 * (3 + 64 * 3) * 2
    for row in report.ledger.per_rank():
        assert row["managed_all_gather"] == {"sent": want, "received": want}
    assert report.ledger.per_table()["managed"]["managed_all_gather"] == 3 * want
    assert "mc gather" in report.text()
    hashed = dry_run(resolve_job(load_config(QUICKSTART)), 3, 3, "cpu").ledger
    assert hashed.totals()["managed_all_gather"] == 0 and "mc gather" not in hashed.text()


def test_dense_bytes_leave_out_sequence_tables():
    """DIN's EmbeddingCollection (the history table) is not DDP's: it must not be counted as
    dense all-reduce bytes (it was, whole in the plan and as the rank's shard in a run)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from recsys_dist.distributed.ledger import dense_parameter_bytes
    from recsys_dist.models.build import build_model

    job = resolve_job(load_config(ROOT / "configs" / "movielens_din.yaml"))
    model = build_model(job.model, job.features, job.train)  # tables on meta
    assert any(isinstance(m, EmbeddingCollection) for m in model.modules())
    tables = {
        id(p)
        for m in model.modules()
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
        for p in m.parameters()
    }
    want = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad and id(p) not in tables)
    assert dense_parameter_bytes(model) == want
    led = dry_run(job, 2, 2, "cpu").ledger
    # 87,432 B: what DDP all-reduced per rank and step in a 2-rank run (counted by CommCounter)
    assert [r["allreduce"]["sent"] for r in led.per_rank()] == [87_432, 87_432] and want <= 87_432


@pytest.mark.parametrize("how", ["sharding_types", "fixed_plan"])
def test_comms_refused_when_every_table_is_data_parallel(how):
    # data_parallel tables have no output_dist: sharding.comms would be silently ignored
    from recsys_dist.train.preflight import table_names

    if how == "sharding_types":
        placed = ["sharding.sharding_types=[data_parallel]", "sharding.compute_kernels=[dense]"]
    else:
        tables = table_names(resolve_job(load_config(QUICKSTART)))
        placed = ["sharding.fixed_plan={" + ", ".join(f"{t}: {{sharding_type: data_parallel}}" for t in tables) + "}"]
    cfg = load_config(QUICKSTART, ["sharding.comms.forward=fp16", "distributed.device=cpu", *placed])
    with pytest.raises(ConfigError, match="sharding.comms: every table is data_parallel"):
        check_before_launch(resolve_job(cfg))
    check_before_launch(resolve_job(load_config(QUICKSTART, ["distributed.device=cpu", *placed])))  # no comms: fine


def test_unsized_multi_hot_features_are_flagged_not_silently_one_hot():
    # MovieLens genres bags hold 2.67 ids on average (ratings_genres_first20000.csv); without
    # data.multi_hot_sizes the ledger counts 1, which the plan and metrics.jsonl must say.
    cfg = load_config(ROOT / "configs" / "movielens_deepfm.yaml")
    led = dry_run(resolve_job(cfg), 2, 2, "cpu").ledger
    assert led.unsized_multi_hot == ["genres"] and led.to_dict()["unsized_multi_hot"] == ["genres"]
    assert "multi-hot features counted as 1 id per example" in led.text() and "genres" in led.text()
    sized_cfg = load_config(ROOT / "configs" / "movielens_deepfm.yaml", ["data.multi_hot_sizes=[1,1,3]"])
    sized = dry_run(resolve_job(sized_cfg), 2, 2, "cpu")
    assert sized.ledger.unsized_multi_hot == [] and sized.ledger.pooling["genres"] == 3.0
    assert dry_run(resolve_job(load_config(QUICKSTART)), 2, 2, "cpu").ledger.unsized_multi_hot == []


def test_comms_refused_on_one_rank():
    # Measured: 1 rank with fp16 comms trains to the fp32 run's numbers to the last bit (no
    # all-to-all leaves the process), so sharding.comms there would be silently ignored.
    cfg = load_config(
        QUICKSTART, ["sharding.comms.forward=fp16", "distributed.device=cpu", "distributed.nproc_per_node=1"]
    )
    with pytest.raises(ConfigError, match="sharding.comms: a job of 1 rank sends nothing between ranks"):
        check_before_launch(resolve_job(cfg))
    check_before_launch(resolve_job(cfg), world_size=2)  # torchrun's job of 2 ranks (1 a node): fine
    with pytest.raises(ConfigError, match="a job of 1 rank"):
        check_before_launch(
            resolve_job(load_config(QUICKSTART, ["sharding.comms.backward=fp16", "distributed.device=cpu"])), 1
        )
    # The library's paths refuse it too: the plan dry run and a Trainer (before it takes its run directory).
    with pytest.raises(ConfigError, match="a job of 1 rank"):
        dry_run(resolve_job(cfg), 1, 1, "cpu")
    assert dry_run(resolve_job(cfg), 2, 2, "cpu").ledger is not None


def test_a_one_rank_trainer_refuses_comms_before_taking_its_run_directory(tmp_path):
    from recsys_dist import Trainer

    cfg = load_config(
        QUICKSTART, ["sharding.comms.forward=fp16", "distributed.device=cpu", "distributed.nproc_per_node=1"]
    )
    with pytest.raises(ConfigError, match="sharding.comms: a job of 1 rank"):
        Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
