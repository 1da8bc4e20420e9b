"""The examples, run as a user runs them, at toy size. (examples/custom_model is run through
the whole CLI by tests/e2e/api/test_custom_model_cli.py.)"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.resolve import prepare_from_config

ROOT = Path(__file__).resolve().parents[3]
TWO_TOWER = ROOT / "examples" / "two_tower"


def column(table, name):
    return table.column(name).to_pylist()


@pytest.mark.slow
def test_two_tower_example_recall_matches_a_brute_force_ranking(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(TWO_TOWER))  # model.name: two_tower:TwoTower, for load_model here
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, str(TWO_TOWER / "train.py"), "--run-dir", str(run_dir)]
        + ["data.num_rows=4000", "train.epochs=2", "train.batch_size=64"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "recall@10  two-tower" in r.stdout and "recall@10  most popular (train ratings)" in r.stdout
    out = json.loads((run_dir / "retrieval.json").read_text())
    names = ["two-tower", "most popular (train ratings)", "most popular (train ratings>=4)"]
    assert list(out["recall"]) == names and out["split"] == "test" and out["k"] == 10

    def recall(entry, name):  # of one user, from their top list: hits / positives
        return sum(i in entry["top"][name] for i in entry["positives"]) / len(entry["positives"])

    for name in names:  # the library's rank_metrics (the printed numbers) against the per-user top lists
        per_user = [recall(u, name) for u in out["per_user"]]
        assert all(0.0 <= x <= 1.0 for x in per_user)
        assert out["recall"][name] == pytest.approx(np.mean(per_user), abs=1e-12)
    # The ranks' sharded model and the unsharded model loaded from the checkpoint agree.
    assert out["pair_score_max_diff"] < 1e-4

    # An independent reference: the converted splits read with pyarrow, the unsharded model's
    # forward scoring one (user, movie) pair per row, Python's sort.
    import recsys_dist

    job, task, _ = recsys_dist.load_model(run_dir)
    model = task.model.eval()
    prepared = prepare_from_config(job.data)
    train, test = (pq.read_table(prepared.paths(s)[0]) for s in ("train", "test"))
    t_user, t_item, t_genres, t_label = (column(train, c) for c in ("userId", "movieId", "genres", "label"))
    h_user, h_item, h_label = (column(test, c) for c in ("userId", "movieId", "label"))
    genres = {}  # movie id -> genres ids, for every movie of the training split: the corpus
    for i, g in zip(t_item, t_genres):
        genres.setdefault(i, g)
    rated = Counter(t_item)
    held_users = sorted({u for u, y in zip(h_user, h_label) if y == 1})
    assert [u["user"] for u in out["per_user"]] == held_users
    assert out["items"] == len(genres)

    for entry in out["per_user"][:: max(1, len(out["per_user"]) // 4)]:  # a few users, spread out
        u = entry["user"]
        seen = {i for uu, i in zip(t_user, t_item) if uu == u}
        candidates = sorted(set(genres) - seen)
        positives = [i for uu, i, y in zip(h_user, h_item, h_label) if uu == u and y == 1]
        assert sorted(entry["positives"]) == sorted(positives)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["userId", "movieId", "genres"],
            torch.tensor([u] * len(candidates) + candidates + [g for i in candidates for g in genres[i]]),
            torch.tensor([1] * 2 * len(candidates) + [len(genres[i]) for i in candidates], dtype=torch.int32),
        )
        with torch.no_grad():
            pair = dict(zip(candidates, model(torch.zeros(len(candidates), 0), kjt).tolist()))
        best = sorted(candidates, key=lambda i: (-pair[i], i))[:10]
        top = entry["top"]["two-tower"]
        assert len(set(top)) == 10 and set(top) <= set(candidates)
        # The same ten scores (robust to float ties at the 10th place), and the same recall.
        assert [pair[i] for i in top] == pytest.approx([pair[i] for i in best], abs=1e-4)
        assert recall(entry, "two-tower") == sum(i in best for i in positives) / len(positives)
        popular = sorted(candidates, key=lambda i: (-rated[i], i))[:10]
        assert entry["top"]["most popular (train ratings)"] == popular
        assert recall(entry, "most popular (train ratings)") == sum(i in popular for i in positives) / len(positives)


@pytest.mark.slow
def test_own_loop_example_resumes_to_the_uninterrupted_losses(tmp_path):
    """examples/own_loop: shard + a plain loop + recsys_dist.save_checkpoint / load_checkpoint
    on 2 ranks. Stopped after step 15 (checkpoints at 10 and 15) and resumed by a second launch,
    every step's loss equals the uninterrupted run's: the table shards, the fused row-wise
    Adagrad state, the dense Adam state, the RNG (dropout) and the loader position all continue."""
    script = ROOT / "examples" / "own_loop" / "train.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RECSYS_DIST_CACHE": str(tmp_path / "cache")}
    runs = {"whole": [], "resumed": ["--stop-at", "15"]}
    losses = {}
    for name, extra in runs.items():
        r = subprocess.run(
            [sys.executable, str(script), "--run-dir", str(tmp_path / name), "--steps", "30", *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert "30 steps" in r.stdout
        losses[name] = json.loads((tmp_path / name / "losses.json").read_text())
    assert len(losses["whole"]) == 30 and all(np.isfinite(losses["whole"]))
    assert losses["resumed"] == losses["whole"]  # exactly: the same ops in the same order
    assert losses["whole"][-1] < losses["whole"][0]  # it learns
    checkpoints = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_00000020", "step_00000030"]  # keep=2
