"""configs/movielens_bst.yaml and movielens_din.yaml end to end. BST: trains on 2 ranks with the
history's EmbeddingCollection table sharded, resumes on 1 rank (twice the per-rank batch) to the
same result as the uninterrupted run, and predicts. Both runs set the transformer's dropout to 0:
on another number of ranks the resumed run draws other dropout masks (each rank draws for its
own rows), so with dropout it continues correctly but not bit for bit; on the same number of
ranks a run with dropout resumes bit for bit. DIN:
trains on 2 ranks with the table sharded (its checkpoint and resume path is BST's: the same
EmbeddingCollection and dense parameters)."""

import json

import pytest

from tests.cli import run_cli
from tests.conftest import ROOT

BST = ROOT / "configs" / "movielens_bst.yaml"
DIN = ROOT / "configs" / "movielens_din.yaml"
COMMON = [
    "train.progress_bar=false",
    "train.max_steps=40",
    "checkpoint.every_n_steps=20",
    "checkpoint.keep=3",  # step 20 stays beside the templates' keep_best checkpoint of step 25 and the last
    "model.transformer_dropout=0",
]


def trains_sharded(config, run_dir, tmp_path, *extra) -> dict:
    """Train on 2 ranks; check the history table is sharded and the test AUC; return summary.json."""
    r = run_cli(["train", "--config", str(config), "--run-dir", str(run_dir), *extra], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = {p["table"]: p for p in json.loads((run_dir / "plan.json").read_text())}
    assert "s_history" in plan and plan["s_history"]["sharding_type"] != "data_parallel"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.6 < summary["test"]["auc"] < 1, (config.name, summary["test"])
    return summary


@pytest.mark.slow
def test_movielens_bst_and_din_train_sharded_bst_resumes_resharded_and_predicts(tmp_path):
    full = tmp_path / "full"
    want = trains_sharded(BST, full, tmp_path, *COMMON)

    resumed = tmp_path / "resumed"
    r = run_cli(
        [
            "train",
            "--config",
            str(BST),
            "--run-dir",
            str(resumed),
            "--resume",
            str(full / "checkpoints" / "step_00000020"),
            "distributed.nproc_per_node=1",
            # one intra-op thread, as each of the 2 ranks had: with 2, a loaded machine's thread
            # timing changed sums at 1e-9 in 1 run of 7, which 20 steps amplified to 1.3e-4 AUC
            "distributed.cpu_threads_per_rank=1",
            "train.batch_size=128",
            *COMMON,
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((resumed / "summary.json").read_text())
    # 1 rank x 128 rows sums the gradients in another order than 2 x 64: the transformer's
    # softmax and LayerNorm carry that rounding to the predictions, and one swapped pair of the
    # ~960,000 test pairs moves AUC by 1e-6, so AUC is compared at 1e-5 (10 pairs), logloss at 1e-6
    for split in ("validation", "test"):
        assert got[split]["auc"] == pytest.approx(want[split]["auc"], abs=1e-5), split
        assert got[split]["logloss"] == pytest.approx(want[split]["logloss"], abs=1e-6), split

    # The same world size with dropout on: each rank gets its own RNG stream back, so the resumed
    # run draws the masks the uninterrupted one drew and ends bit for bit where it ended (with
    # one stream saved for all ranks, rank 1 drew rank 0's masks: 2.2e-3 NE off).
    dropout = [*(c for c in COMMON if not c.startswith("model.transformer_dropout=")), "model.transformer_dropout=0.1"]
    want = trains_sharded(BST, tmp_path / "full_dropout", tmp_path, *dropout)
    step20 = tmp_path / "full_dropout" / "checkpoints" / "step_00000020"
    resumed = tmp_path / "resumed_dropout"
    r = run_cli(["train", "--config", BST, "--run-dir", resumed, "--resume", step20, *dropout], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((resumed / "summary.json").read_text())
    for split in ("validation", "test"):
        assert (got[split]["auc"], got[split]["logloss"]) == (want[split]["auc"], want[split]["logloss"]), split

    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    preds = tmp_path / "preds.parquet"
    p = run_cli(["predict", str(full), "--data", str(manifest.parent / "test.parquet"), "--out", str(preds)], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]

    # DIN on the same conversion (one cache entry): trains sharded; 30 steps, no checkpoints
    trains_sharded(
        DIN,
        tmp_path / "din",
        tmp_path,
        "train.progress_bar=false",
        "train.max_steps=30",
        "checkpoint.enabled=false",
        "checkpoint.keep_best=false",
    )
    # its ledger: the dense all-reduce is DDP's (87,432 B a rank and step, counted at the
    # collectives), not the history table's shard; the table itself is named as not counted
    lines = [json.loads(ln) for ln in (tmp_path / "din" / "metrics.jsonl").read_text().splitlines()]
    (ledger,) = [ln for ln in lines if ln.get("split") == "ledger"]
    assert [r["allreduce"]["sent"] for r in ledger["per_rank"]] == [87_432, 87_432]
    assert ledger["unmodelled_tables"] == ["s_history"]
