"""configs/movielens_two_tower.yaml end to end, one CLI sequence: trains a few steps on 2 ranks
(tables sharded), resumes from the mid-run checkpoint to the same metrics, exports the
2-rank checkpoint as one unsharded model with the item embeddings, and the export's
embeddings give, by a brute-force numpy ranking, the recall@10 / NDCG@10 that the sharded run
reported."""

import json

import numpy as np
import pytest

from tests.cli import read_metrics, run_cli
from tests.conftest import ROOT
from tests.unit.models.test_two_tower import brute_force

TWO_TOWER = ROOT / "configs" / "movielens_two_tower.yaml"
COMMON = [
    "train.progress_bar=false",
    "train.max_steps=6",
    "checkpoint.every_n_steps=3",
    "checkpoint.keep=2",
    "train.log_every_n_steps=3",
    "eval.retrieval_k=[10]",
]
KEYS = ("auc", "logloss", "recall@10", "ndcg@10", "popular_recall@10")


@pytest.mark.slow
def test_movielens_two_tower_trains_resumes_exports_and_recall_matches_brute_force(tmp_path, monkeypatch):
    import torch

    from recsys_dist.cli.report import report
    from recsys_dist.models.retrieval import make_kjt, read_retrieval_data
    from recsys_dist.serve.export import export, load_model

    full = tmp_path / "full"
    r = run_cli(["train", "--config", str(TWO_TOWER), "--run-dir", str(full), *COMMON], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = {p["table"]: p["sharding_type"] for p in json.loads((full / "plan.json").read_text())}
    assert set(plan) == {"t_userId", "t_movieId", "t_genres"}
    want = json.loads((full / "summary.json").read_text())
    test = want["test"]
    assert test["corpus_items"] > 4000 and test["retrieval_users"] > 100
    assert all(0 <= test[k] <= 1 for k in ("recall@10", "ndcg@10", "popular_recall@10", "popular_ndcg@10"))
    lines = read_metrics(full)
    assert any(m["split"] == "validation" and "recall@10" in m for m in lines)
    text = report(full, plots=False)
    assert "popular recall" in text and f"{test['recall@10']:.4f}" in text

    resumed = tmp_path / "resumed"
    r = run_cli(
        [
            "train",
            "--config",
            str(TWO_TOWER),
            "--run-dir",
            str(resumed),
            "--resume",
            str(full / "checkpoints" / "step_00000003"),
            *COMMON,
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((resumed / "summary.json").read_text())
    assert got["resumed_at_step"] == 3
    for split in ("validation", "test"):
        for k in KEYS:
            assert got[split][k] == pytest.approx(want[split][k], abs=1e-6), (split, k)

    out = tmp_path / "export"  # what `recsys-dist export` calls, in this process (one torchrec import less)
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(tmp_path / "cache"))
    export(full, out)
    ids, vecs = np.load(out / "item_ids.npy"), np.load(out / "item_embeddings.npy")
    assert ids.dtype == np.int64 and vecs.dtype == np.float32 and vecs.shape == (test["corpus_items"], 32)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert np.load(out / "item_keys.npy").shape == ids.shape

    # The export (the 2-rank checkpoint in one process) against the sharded run's numbers.
    job, task, _ = load_model(out)
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    paths = {s: [str(manifest.parent / f"{s}.parquet")] for s in ("train", "validation", "test")}
    # the run load_model gives is sized as the exported tables
    assert job.table_sizes == [t.num_embeddings for t in task.model.sparse_arch.embedding_bag_configs()]
    data = read_retrieval_data(job, paths)
    assert np.array_equal(data.corpus.ids, ids)
    users = data.splits["test"]
    with torch.no_grad():
        u = task.model.user_vectors(make_kjt(data.sparse_names, users.users, np.arange(len(users.users.ids))))
    scores = u.double().numpy() @ vecs.astype(np.float64).T  # [users, corpus]
    recall, ndcg = brute_force(scores, ids, users.positives, users.seen, 10)
    assert recall == pytest.approx(test["recall@10"], abs=1e-6)
    assert ndcg == pytest.approx(test["ndcg@10"], abs=1e-6)
