"""The quickstart's numbers: 1 rank vs 2 ranks, float32 vs bf16-mixed (split from
test_quickstart.py so that the two files run on different test workers)."""

import pytest

from tests.cli import read_metrics, run_train
from tests.conftest import QUICKSTART
from tests.e2e.test_quickstart import FAST


@pytest.mark.slow
def test_world_size_1_and_2_give_the_same_numbers(tmp_path):
    """Same global batch (64) on 1 rank and on 2 ranks x 32, row-wise vs unsharded tables.

    Embedding init depends on (seed, table, row) only (recsys_dist.distributed.tables.init_tables), so
    both runs start from the same model; tolerance 1e-5 (float32 reduction order). The 2-rank
    run spawns its ranks (the CUDA way) instead of forking them (the CPU default)."""
    common = [*FAST, "train.deterministic=true", "checkpoint.enabled=false"]
    runs = {}
    for name, extra in {
        "ws1": ["distributed.nproc_per_node=1", "train.batch_size=64"],
        "ws2": ["sharding.sharding_types=[row_wise]", "distributed.start_method=spawn"],
    }.items():
        r = run_train(QUICKSTART, tmp_path / name, *common, *extra, tmp=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = read_metrics(tmp_path / name)
    assert len(runs["ws1"]) == len(runs["ws2"])
    # Every line's numbers are compared: a train line's loss, an eval line's AUC and logloss
    # (a ledger line counts bytes on the wire, which depend on the world size).
    compared = {"train": ("loss",), "validation": ("auc", "logloss"), "test": ("auc", "logloss")}
    assert set(compared) <= {a["split"] for a in runs["ws1"]}
    for a, b in zip(runs["ws1"], runs["ws2"]):
        assert a["split"] == b["split"] and a["step"] == b["step"]
        for key in compared.get(a["split"], ()):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a, b)


@pytest.mark.slow
def test_bf16_mixed_trains_the_quickstart_as_well_as_float32(tmp_path):
    """The README's quickstart (float32: validation AUC 0.7228, logloss 0.4823; test AUC
    0.7574, logloss 0.4638) with the dense tower in bfloat16 autocast."""
    run_dir = tmp_path / "bf16"
    r = run_train(
        QUICKSTART,
        run_dir,
        "train.precision=bf16-mixed",
        "checkpoint.enabled=false",
        "train.progress_bar=false",
        tmp=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = {m["split"]: m for m in read_metrics(run_dir) if m["split"] in ("validation", "test")}
    assert got["validation"]["auc"] == pytest.approx(0.7228, abs=0.005)
    assert got["validation"]["logloss"] == pytest.approx(0.4823, abs=0.005)
    assert got["test"]["auc"] == pytest.approx(0.7574, abs=0.01)
    assert got["test"]["logloss"] == pytest.approx(0.4638, abs=0.005)
