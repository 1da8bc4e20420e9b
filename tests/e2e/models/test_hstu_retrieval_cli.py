"""configs/movielens_hstu_retrieval.yaml end to end, one CLI sequence: trains a few steps on 2
ranks (the shared item table sharded), resumes from the mid-run checkpoint to the same metrics,
and the run's HR@K / NDCG@K / MRR equal, on the saved checkpoint's weights in one process, both
the model's own evaluator at 1 rank and the library's ``evaluate_next_item`` (dense item ids) on
the library's leave-last-out split of the raw file (``next_item.leave_last_out``: its targets and
histories are the run's held-out rows). Then ``model.name=sasrec_retrieval`` on the same file
trains on 2 ranks through the same path (the pipeline traces it) to the same held-out rows."""

import csv
import json

import numpy as np
import pyarrow as pa
import pytest

from tests.cli import read_metrics, run_cli
from tests.conftest import ROOT
from tests.unit.models.test_hstu_next_item import dense_copy

CONFIG = ROOT / "configs" / "movielens_hstu_retrieval.yaml"
COMMON = [
    "train.progress_bar=false",
    "train.max_steps=6",
    "checkpoint.every_n_steps=3",
    "checkpoint.keep=2",
    "train.log_every_n_steps=3",
    "data.num_embeddings=20011",  # a smaller table than the shipped one: faster checkpoints
]
KEYS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "mrr", "popular_mrr")


@pytest.mark.slow
def test_movielens_hstu_retrieval_trains_resumes_and_metrics_equal_the_library_evaluate(tmp_path):
    import torch

    from recsys_dist.data.mapping import hash_ids, text_keys
    from recsys_dist.models.hstu_retrieval import evaluate_next_item
    from recsys_dist.models.next_item import leave_last_out
    from recsys_dist.models.zoo.hstu_next_item import next_item_metrics, read_next_item_data
    from recsys_dist.serve.export import load_model

    full = tmp_path / "full"
    r = run_cli(["train", "--config", str(CONFIG), "--run-dir", str(full), *COMMON], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "HR@10" in r.stdout and "MRR" in r.stdout, r.stdout[-2000:]
    plan = {p["table"] for p in json.loads((full / "plan.json").read_text())}
    assert plan == {"s_history"}  # one table: the history and the item read it
    want = json.loads((full / "summary.json").read_text())
    lines = {m["split"]: m for m in read_metrics(full) if m["split"] in ("validation", "test")}
    for split in ("validation", "test"):
        m = lines[split]
        # leave-last-out: one target per user (133), each with a history
        assert m["step"] == 6 and m["next_item_rows"] == 133 and m["next_item_skipped"] == 0 and m["catalogue"] > 4000
        assert all(0 <= m[k] <= 1 for k in KEYS) and m["hr@10"] <= m["hr@50"]
        assert want[split]["mrr"] == pytest.approx(m["mrr"])

    resumed = tmp_path / "resumed"
    r = run_cli(
        [
            "train",
            "--config",
            str(CONFIG),
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

    # The 2-rank checkpoint in this process (1 rank, unsharded) against the sharded run's lines.
    job, task, _ = load_model(full)
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    files = json.loads(manifest.read_text())["files"]
    data = read_next_item_data(job, {s: [str(manifest.parent / f) for f in files[s]] for s in files})
    cat = data.catalogue
    lib = dense_copy(task.model, cat, job.model)
    raw = list(csv.DictReader(open(ROOT / "datasets" / "movielens" / "ratings_genres_first20000_by_time.csv")))
    split_of = leave_last_out(*(np.array([int(r[k]) for r in raw]) for k in ("userId", "movieId", "timestamp")))
    table_id = hash_ids(text_keys(pa.array([str(x) for x in split_of.items]))[0], 20011)  # raw item -> table id
    for split in ("validation", "test"):
        one_rank = next_item_metrics(task.model, data, split, job, torch.device("cpu"))
        histories = [table_id[h - 1] for h in split_of.histories(split, 50)]
        assert [h.tolist() for h in histories] == [h.tolist() for h in data.histories[split]]
        assert table_id[split_of.targets(split) - 1].tolist() == data.targets[split].tolist()
        dense = [np.searchsorted(cat, h) + 1 for h in histories]
        targets = np.searchsorted(cat, table_id[split_of.targets(split) - 1]) + 1
        library = evaluate_next_item(lib, dense, targets, len(cat), ks=(10, 50))
        for k in KEYS:
            assert one_rank[k] == pytest.approx(lines[split][k], abs=1e-9), (split, k)
            if not k.startswith("popular"):
                assert library[k] == pytest.approx(lines[split][k], abs=1e-6), (split, k)

    # model.name: sasrec_retrieval, the same file and data: 2 ranks, traced pipeline, the same evaluation.
    sasrec = tmp_path / "sasrec"
    overrides = ["model.name=sasrec_retrieval", "model.max_length=50", *COMMON]
    r = run_cli(["train", "--config", str(CONFIG), "--run-dir", str(sasrec), *overrides], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p["table"] for p in json.loads((sasrec / "plan.json").read_text())} == {"s_history"}
    held_out = {m["split"]: m for m in read_metrics(sasrec) if m["split"] in ("validation", "test")}
    assert set(held_out) == {"validation", "test"}
    for m in held_out.values():
        assert m["step"] == 6 and m["next_item_rows"] == 133 and m["catalogue"] == lines[m["split"]]["catalogue"]
        assert all(0 <= m[k] <= 1 for k in KEYS) and m["popular_mrr"] == lines[m["split"]]["popular_mrr"]
