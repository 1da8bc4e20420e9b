"""Online training (``data.stream``, configs/criteo_online.yaml) under ``sharding.replica_groups``
at 4 ranks, 2 groups of 2: every partition row trained once, the same losses, progressive
validation and published weights as one group of 4 (exact_sgd synced every step); with the sync
every 1000 steps (none while training) each publish is of the synced model (the version equals
the checkpoint of its step, which settles the replicas: one model, not rank 0's replica); the
server's scores of the latest version equal ``recsys-dist predict`` on its folded export."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file
from starlette.testclient import TestClient

from recsys_dist.serve.http import ModelHolder, create_app, open_source
from tests.cli import read_metrics, run_cli, run_train
from tests.unit.train.test_stream import CONFIG, NAMES, ROWS, land, overrides

RUNS = {
    "one": {},
    "two": {"sharding.replica_groups": "2"},
    "lazy": {"sharding.replica_groups": "2", "sharding.replica_sync_every": "1000"},
}
KEYS = {"distributed.nproc_per_node": "4", "train.embedding_optimizer": "exact_sgd", "checkpoint.every_n_steps": "50"}


def _export(tmp_path, args: list, out) -> dict:
    r = run_cli(["export", *args, "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(900)  # three 4-rank stream runs
def test_stream_under_replica_groups_trains_each_row_once_as_one_group_and_publishes_synced(tmp_path):
    landing = tmp_path / "landing"
    for name in NAMES:
        land(landing, name)
    env = {"RECSYS_DIST_CACHE": str(tmp_path)}
    lines, folded = {}, {}
    for name, extra in RUNS.items():
        run = tmp_path / name
        r = run_train(CONFIG, run, *overrides(landing, **KEYS, **extra), tmp=tmp_path, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        lines[name] = read_metrics(run)
        # every partition's rows once: 640 rows = 5 global batches of 128 each
        assert [(m["partition"], m["rows"], m["step"]) for m in read_metrics(run, "partition")] == [
            (NAMES[0], ROWS, 5),
            (NAMES[1], ROWS, 10),
            (NAMES[2], ROWS, 15),
        ]
        folded[name] = _export(tmp_path, ["--from-publish", str(run / "publish")], tmp_path / f"folded_{name}")
    assert lines["two"][0]["replica_groups"] == 2 and lines["two"][0]["world_size"] == 2  # the ledger: one group

    def numbers(name: str, split: str, key: str) -> list[float]:
        return [m[key] for m in lines[name] if m["split"] == split]

    for split, key in (("train", "loss"), ("validation", "auc")):
        one, two = numbers("one", split, key), numbers("two", split, key)
        assert len(one) >= 3 and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(two, one, strict=True)), split
    one_w, two_w = folded["one"], folded["two"]
    assert one_w.keys() == two_w.keys()
    # float rounding (the replicas' average, the dense tower's Adagrad): measured 1.04e-6
    assert max((two_w[k] - v).abs().max().item() for k, v in one_w.items()) < 1e-5

    # No sync while training: the publish after partition 3 is the checkpoint of step 15 (the
    # replicas averaged before it), within float rounding; a replica's own tables would differ.
    lazy = tmp_path / "lazy"
    saved = _export(tmp_path, [str(lazy)], tmp_path / "lazy_checkpoint")
    assert saved.keys() == folded["lazy"].keys()
    assert max((folded["lazy"][k] - v).abs().max().item() for k, v in saved.items()) < 1e-6
    tables = [k for k in one_w if "embedding_bags" in k]
    assert tables and 0 < max((folded["lazy"][k] - one_w[k]).abs().max().item() for k in tables) < 5e-4

    rows = (landing / NAMES[2]).read_text().splitlines()[:50]
    (tmp_path / "rows.txt").write_text("\n".join(rows) + "\n")
    scored = tmp_path / "p_two.parquet"
    r = run_cli(
        ["predict", str(tmp_path / "folded_two"), "--data", str(tmp_path / "rows.txt"), "--out", str(scored)], tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    with TestClient(create_app(ModelHolder(open_source(tmp_path / "two" / "publish"), 0))) as c:
        served = c.post("/score", json={"rows": rows}).json()
    assert served["version"] == 3
    np.testing.assert_allclose(served["logits"], pq.read_table(scored)["logit"].to_numpy(), rtol=0, atol=1e-6)
