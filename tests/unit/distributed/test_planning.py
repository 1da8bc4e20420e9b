"""Dry-run planning: no process group, no GPU, any world size."""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.dry_run import PlanError, dry_run
from tests.conftest import QUICKSTART, ROOT

MLPERF = ROOT / "configs" / "mlperf_dlrmv2.yaml"


def test_mlperf_fits_8_gpus_of_80gb():
    cfg = load_config(MLPERF, ["sharding.hbm_gb=80"])
    report = dry_run(resolve_job(cfg), 8, 8, "cuda")
    assert sorted(p.table for p in report.placements) == sorted(f"t_C{i}" for i in range(1, 27))
    assert all(h <= 80 * 0.95 for h in report.hbm_gb)
    # fp32 weights (~97.4 GiB) + exact Adagrad state of the same size must all be placed.
    assert sum(report.hbm_gb) > 2 * 97
    assert report.imbalance >= 1.0 and len(report.cost_ms) == 8


def test_mlperf_on_one_gpu_fails_naming_tables():
    cfg = load_config(MLPERF, ["sharding.hbm_gb=80"])
    with pytest.raises(PlanError) as e:
        dry_run(resolve_job(cfg), 1, 1, "cuda")
    msg = str(e.value)
    assert "no sharding plan fits 1 rank(s)" in msg and "t_C1 (38.1 GiB)" in msg
    assert "use at least 3 ranks" in msg and "fused_uvm_caching" in msg


def test_constraints_are_respected_on_cpu():
    cfg = load_config(
        QUICKSTART, ["sharding.sharding_types=[table_wise]", "sharding.per_table={t_C1: {sharding_types: [row_wise]}}"]
    )
    report = dry_run(resolve_job(cfg), 3, 3, "cpu")
    types = {p.table: p.sharding_type for p in report.placements}
    assert types.pop("t_C1") == "row_wise"
    assert set(types.values()) == {"table_wise"}
    assert {r for p in report.placements for r in p.ranks} == {0, 1, 2}


def test_unknown_table_in_per_table_is_an_error():
    cfg = load_config(QUICKSTART, ["sharding.per_table={t_X: {sharding_types: [row_wise]}}"])
    with pytest.raises(ValueError, match=r"sharding.per_table: unknown tables \['t_X'\]"):
        dry_run(resolve_job(cfg), 2, 2, "cpu")


def test_column_shards_must_be_multiples_of_4():
    import torch

    from recsys_dist.distributed.fixed_plan import fixed_sharding_plan
    from recsys_dist.models.build import build_model

    job = resolve_job(load_config(QUICKSTART))
    model = build_model(job.model, job.features.on(torch.device("meta")), job.train)
    fixed = load_config(QUICKSTART, ["sharding.fixed_plan={t_C1: {sharding_type: column_wise, ranks: [0, 1, 2]}}"])
    with pytest.raises(ValueError, match=r"t_C1: 16 columns over 3 shards gives width 5.33.*use \[1, 2, 4\] shards"):
        fixed_sharding_plan(model, fixed.sharding.fixed_plan, 3, 3, "cpu")
    with pytest.raises(ConfigError, match="model.embedding_dim: 6 is not a multiple of 4.*use 4 or 8"):
        from recsys_dist.train.preflight import check_before_launch

        check_before_launch(
            resolve_job(load_config(QUICKSTART, ["model.embedding_dim=6", "model.dense_arch_layer_sizes=[6]"]))
        )


def test_the_plan_does_not_depend_on_the_string_hash_seed(monkeypatch):
    """TorchRec's enumerator intersects sharding types as sets (order: the process's hash seed)
    and the planner keeps the first of tied options: equal runs of the 2-rank quickstart were
    planned row_wise or table_row_wise. Ours keeps the sharder's order, whatever the sets give."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    def scrambled(parent, reverse: bool):
        return lambda *a, **k: parent(*a, **k)[:: -1 if reverse else 1]

    plans = []
    for reverse in (False, True):  # two set orders
        for name in ("_filter_sharding_types", "_filter_compute_kernels"):
            monkeypatch.setattr(EmbeddingEnumerator, name, scrambled(getattr(EmbeddingEnumerator, name), reverse))
        report = dry_run(resolve_job(load_config(QUICKSTART)), 2, 2, "cpu")
        plans.append(sorted((p.table, p.sharding_type, p.compute_kernel) for p in report.placements))
        monkeypatch.undo()
    assert plans[0] == plans[1]
    assert {t for _, t, _ in plans[0]} == {"row_wise"}  # the first of the tie in the sharder's order
