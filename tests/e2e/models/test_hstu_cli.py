"""configs/movielens_hstu.yaml end to end: trains on 2 ranks with the history's
EmbeddingCollection table sharded, resumes on 1 rank (twice the per-rank batch, layer dropout 0:
see test_din_cli.py for why) to the uninterrupted run's metrics, exports; ``predict`` on the
export equals its ``evaluate``; ``recsys-dist serve`` scores a user's history + candidates over
HTTP as ``predict`` scores the same rows in a file, and refuses a history out of time order.
Online (data.stream): three landed MovieLens partitions trained each row once across a SIGTERM
and a resume, published and served; histories carried across partitions as one file's (a late
partition quarantined), kept exactly with the checkpoints."""

import csv
import io
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from sklearn.metrics import log_loss, roc_auc_score
from starlette.testclient import TestClient

import recsys_dist
from recsys_dist.checkpoint.dcp import latest_checkpoint
from recsys_dist.data.stream import convert_partition
from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.publish import load_published
from recsys_dist.train.stream_state import load_histories
from tests.cli import read_metrics, run_cli
from tests.conftest import ROOT
from tests.e2e.models.test_din_cli import trains_sharded

HSTU = ROOT / "configs" / "movielens_hstu.yaml"
RAW = ROOT / "datasets" / "movielens" / "ratings_genres_first20000_by_time.csv"
COMMON = [
    "train.progress_bar=false",
    "train.max_steps=40",
    "checkpoint.every_n_steps=20",
    "checkpoint.keep=3",
    "model.layer_dropout=0",
]


def cli(args, tmp):
    r = run_cli(args, tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def history_and_candidates() -> tuple[list[str], list[dict]]:
    """The raw file's header and rows scored: user 15's first 60 ratings (its history, in time
    order, 10 more than the history's max_length of 50; their ratings are the history's actions),
    then 5 candidate movies at one later time (ties: a candidate never sees another; their
    ratings, another user's, never enter a history)."""
    lines = RAW.read_text().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, r)) for r in csv.reader(lines[1:])]
    user = [r for r in rows if r["userId"] == "15"][:60]
    assert len(user) == 60
    later = str(int(user[-1]["timestamp"]) + 60)
    others = [r for r in rows if r["userId"] != "15"][:5]
    candidates = [{**r, "userId": "15", "timestamp": later} for r in others]
    return header, [{k: r[k] for k in header} for r in user + candidates]


def as_request(row: dict) -> dict:
    """A raw row as a JSON object: ids and the time as integers, genres as a list, the rating
    (the history's action in the shipped config) as a number."""
    out = {k: int(v) for k, v in row.items() if k in ("userId", "movieId", "timestamp")}
    return {**out, "genres": row["genres"].split("|"), "rating": float(row["rating"])}


def post(url: str, rows: list) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{url}/score", data=json.dumps({"rows": rows}).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        return 200, json.loads(urllib.request.urlopen(req, timeout=60).read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def serves(export, rows: list[dict], want: np.ndarray) -> None:
    """``recsys-dist serve EXPORT``: the rows' logits equal ``want``; the candidates alone score
    otherwise (the history is read) and the same with the oldest 10 events left out (the history
    keeps the last 50); a history out of time order is a 400 naming row and column."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "recsys_dist.cli.main", "serve", str(export), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert "in-memory scoring" in proc.stdout.readline()  # printed once listening
        code, got = post(url, [as_request(r) for r in rows])
        assert code == 200, got
        np.testing.assert_allclose(got["logits"], want, rtol=0, atol=1e-6)
        code, alone = post(url, [as_request(r) for r in rows[-5:]])
        assert code == 200 and np.abs(np.array(alone["logits"]) - want[-5:]).min() > 1e-4
        # over-long: the candidates read the most recent 50 events (docs/data.md), so the first
        # 10 of the 60 change nothing
        code, last50 = post(url, [as_request(r) for r in rows[10:]])
        assert code == 200
        np.testing.assert_allclose(last50["logits"][-5:], want[-5:], rtol=0, atol=1e-6)
        swapped = [as_request(r) for r in rows]
        swapped[2], swapped[3] = swapped[3], swapped[2]  # times 997937239 and 997937311
        code, err = post(url, swapped)
        assert code == 400 and "rows[3], column timestamp" in err["error"] and "non-decreasing" in err["error"], err
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_movielens_hstu_trains_sharded_resumes_resharded_exports_predicts_and_serves(tmp_path):
    full = tmp_path / "full"
    want = trains_sharded(HSTU, full, tmp_path, *COMMON)
    trains_under_pipeline_as_ddp(full, want, tmp_path)

    resumed = tmp_path / "resumed"
    step20 = full / "checkpoints" / "step_00000020"
    cli(
        ["train", "--config", HSTU, "--run-dir", resumed, "--resume", step20]
        # one intra-op thread, as each of the 2 ranks had (test_din_cli.py says why)
        + ["distributed.nproc_per_node=1", "distributed.cpu_threads_per_rank=1", "train.batch_size=128", *COMMON],
        tmp_path,
    )
    got = json.loads((resumed / "summary.json").read_text())
    # another summation order of the gradients (1 x 128 rows, not 2 x 64): BST's tolerances
    for split in ("validation", "test"):
        assert got[split]["auc"] == pytest.approx(want[split]["auc"], abs=1e-5), split
        assert got[split]["logloss"] == pytest.approx(want[split]["logloss"], abs=1e-6), split

    export = tmp_path / "export"
    cli(["export", full, "--out", export], tmp_path)
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    test = manifest.parent / "test.parquet"
    ev = json.loads(cli(["evaluate", export, "--data", test], tmp_path).stdout.strip().splitlines()[-1])
    preds = tmp_path / "preds.parquet"
    cli(["predict", export, "--data", test, "--out", preds], tmp_path)
    prob = pq.read_table(preds).column("probability").to_numpy().astype(np.float64)
    label = pq.read_table(test).column("label").to_numpy()
    assert ev["num_examples"] == len(prob) == 2000
    assert ev["auc"] == pytest.approx(roc_auc_score(label, prob), abs=1e-6)
    assert ev["logloss"] == pytest.approx(log_loss(label, prob), abs=1e-6)

    predict_is_served(export, tmp_path)


def predict_is_served(export, tmp_path) -> None:
    """Raw rows (a user's history + candidates): ``predict`` on ``export`` writes the logits that
    ``recsys-dist serve`` answers for the same rows."""
    header, rows = history_and_candidates()
    buf = io.StringIO()
    w = csv.DictWriter(buf, header, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    (tmp_path / "rows.csv").write_text(buf.getvalue())
    cli(["predict", export, "--data", tmp_path / "rows.csv", "--out", tmp_path / "rows.parquet"], tmp_path)
    serves(export, rows, pq.read_table(tmp_path / "rows.parquet").column("logit").to_numpy())


# 2 microbatches: each one rank's 64 rows, as ddp computes them. With 4 (32 rows) the sums round
# otherwise (1e-7) and the shipped Adagrad amplifies that to 8e-4 by step 40 (measured; under
# plain SGD 1e-7 at step 40; tests/ranks/distributed/test_hstu_pipeline.py checks 4 under SGD).
PIPELINE = ["distributed.dense.strategy=pipeline", "distributed.dense.stages=2", "distributed.dense.microbatches=2"]


def trains_under_pipeline_as_ddp(ddp, want: dict, tmp_path) -> None:
    """Issue 38 item 6: the same run (``COMMON``: layer dropout off) under
    ``distributed.dense.strategy=pipeline`` (2 stages, 1f1b, 2 microbatches): ``plan`` shows
    HSTU's stages; it logs ddp's losses (1e-5 relative) and validation / test numbers; its
    step-20 checkpoint resumes under pipeline to its own end; its export scores the test split
    as its run did (``evaluate`` = ``predict``'s rows)."""
    plan = cli(["plan", "--config", HSTU, "--world-size", "2", *PIPELINE], tmp_path).stdout
    assert "2 stages, 1 per rank" in plan and "input [B, 865]" in plan, plan[-2000:]
    pipe = tmp_path / "pipe"
    got = trains_sharded(HSTU, pipe, tmp_path, *COMMON, *PIPELINE)
    losses = {run: [m["loss"] for m in read_metrics(run, "train")] for run in (ddp, pipe)}
    assert len(losses[pipe]) >= 2 and len(losses[pipe]) == len(losses[ddp]), losses
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses[pipe], losses[ddp], strict=True)), losses
    for split in ("validation", "test"):
        assert got[split]["auc"] == pytest.approx(want[split]["auc"], abs=1e-5), split
    resumed = tmp_path / "pipe_resumed"
    cli(["train", "--config", HSTU, "--run-dir", resumed, "--resume", pipe / "checkpoints" / "step_00000020"]
        + [*COMMON, *PIPELINE], tmp_path)  # fmt: skip
    end = read_metrics(resumed, "train")
    assert end and end[0]["step"] > 20 and end[-1]["step"] == 40, end  # resumed at 20, not from 0
    assert end[-1]["loss"] == pytest.approx(losses[pipe][-1], rel=1e-6)
    again = json.loads((resumed / "summary.json").read_text())
    for split in ("validation", "test"):
        assert again[split]["auc"] == pytest.approx(got[split]["auc"], abs=1e-6), split
    export = tmp_path / "pipe_export"
    cli(["export", pipe, "--out", export], tmp_path)
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    test = manifest.parent / "test.parquet"
    ev = json.loads(cli(["evaluate", export, "--data", test], tmp_path).stdout.strip().splitlines()[-1])
    assert ev["num_examples"] == 2000 and ev["auc"] == pytest.approx(got["test"]["auc"], abs=1e-6)
    preds = tmp_path / "pipe_preds.parquet"
    cli(["predict", export, "--data", test, "--out", preds], tmp_path)
    prob = pq.read_table(preds).column("probability").to_numpy().astype(np.float64)
    assert ev["auc"] == pytest.approx(roc_auc_score(pq.read_table(test).column("label").to_numpy(), prob), abs=1e-6)


PARTS = ["day=0/part-0.csv", "day=1/part-0.csv", "day=2/part-0.csv"]
PART_ROWS = 640  # 10 global batches of 2 x 32
LATE = "day=1/part-1.csv"  # user 8's rating at a time before its later ones of day=1: quarantined


def stream_config(tmp, late: bool = False, dropout: float = 0.0) -> tuple:
    """movielens_hstu.yaml as an online run (hash mapping: a stream has no vocabulary up front),
    over 3 partitions of 640 rows of the raw file (each with the header), landed as a writer
    lands them (a hidden file, then a rename), and ``LATE`` (with ``late``): a copy of the first
    row of the second, whose user has later rows there; ``model.layer_dropout``: ``dropout``.
    Returns (config path, landing dir)."""
    cfg = yaml.safe_load(HSTU.read_text())
    landing = tmp / "landing"
    lines = RAW.read_text().splitlines(keepends=True)
    parts = {name: lines[1 + i * PART_ROWS : 1 + (i + 1) * PART_ROWS] for i, name in enumerate(PARTS)}
    if late:
        parts[LATE] = parts[PARTS[1]][:1]
    for name, rows in parts.items():
        target = landing / name
        target.parent.mkdir(parents=True, exist_ok=True)
        hidden = target.parent / f".{target.name}.tmp"
        hidden.write_text("".join([lines[0], *rows]))
        os.replace(hidden, target)
    d = cfg["data"]
    for key in ("raw_path", "split", "min_count"):
        del d[key]
    d.update(
        categorical_mapping="hash",
        num_embeddings=2000,
        stream={"path": str(landing), "pattern": "*/*.csv", "poll_seconds": 0.2, "stop_after_idle_seconds": 0},
    )
    cfg["model"]["layer_dropout"] = dropout
    cfg["train"] = {k: v for k, v in cfg["train"].items() if k not in ("epochs", "early_stopping")}
    cfg["train"].update(batch_size=32, progress_bar=False, deterministic=True)
    cfg["checkpoint"] = {"enabled": True, "every_n_steps": 5}
    cfg["eval"] = {"batch_size": 256}
    cfg["publish"] = {"enabled": True, "every_partition": True, "quantize": "none"}
    path = tmp / "hstu_online.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, landing


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hstu_online_trains_each_partition_row_once_across_a_stop_and_publishes(tmp_path):
    # With dropout: the masks continue across the stops only if publishing (rank 0 builds an
    # unsharded model, again in a resumed process) leaves the training's random state alone.
    config, landing = stream_config(tmp_path, late=True, dropout=0.2)
    ref = tmp_path / "ref"
    cli(["train", "--config", config, "--run-dir", ref], tmp_path)
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["partitions"] == PARTS and summary["rows_trained"] == 3 * PART_ROWS and summary["steps"] == 30
    # late data: a row before its user's carried events quarantines its partition, naming the line
    (late,) = summary["quarantined"].items()
    assert late[0] == LATE and "part-1.csv, line 2, column timestamp: 1154464756 is earlier than 1154474527" in late[1]
    assert "of a partition trained before" in late[1], late
    parts = read_metrics(ref, "partition")
    assert [(p["partition"], p["rows"], p["step"]) for p in parts] == [
        (PARTS[0], PART_ROWS, 10),
        (PARTS[1], PART_ROWS, 20),
        (PARTS[2], PART_ROWS, 30),
    ]
    vals = read_metrics(ref, "validation")  # each partition scored before it is trained on
    assert [(v["partition"], v["step"], v["num_examples"]) for v in vals] == [
        (PARTS[0], 0, PART_ROWS),
        (PARTS[1], 10, PART_ROWS),
        (PARTS[2], 20, PART_ROWS),
    ]

    # Stopped by SIGTERM after step 16 (inside partition 2: the resume converts it again from
    # the state carried before it), resumed and stopped again after its end (between partitions:
    # SIGTERM at step 18 is acted on at the next look for a partition), resumed: the same lines
    # and weights.
    run = tmp_path / "run"
    r = run_cli(["train", "--config", config, "--run-dir", run], tmp_path, env={"RECSYS_DIST_FAULT": "sigterm:16:0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["rows_trained"] == 16 * 64
    resume = ["train", "--config", config, "--run-dir", run, "--resume", "auto"]
    r = run_cli(resume, tmp_path, env={"RECSYS_DIST_FAULT": "sigterm:18:0"})
    assert r.returncode == 0, r.stderr[-3000:]
    between = json.loads((run / "summary.json").read_text())
    assert (between["rows_trained"], between["partitions"], between["quarantined"]) == (20 * 64, PARTS[:2], {})
    cli(resume, tmp_path)
    assert json.loads((run / "summary.json").read_text())["rows_trained"] == 3 * PART_ROWS
    timing = ("samples_per_s", "seconds")
    assert [{k: v for k, v in m.items() if k not in timing} for m in read_metrics(run)] == [
        {k: v for k, v in m.items() if k not in timing} for m in read_metrics(ref)
    ]

    manifest = json.loads((run / "publish" / "manifest.json").read_text())
    assert [(v["version"], v["kind"], v["step"]) for v in manifest["versions"]] == [
        (1, "full", 10),
        (2, "delta", 20),
        (3, "delta", 30),
    ]
    model, version = load_published(run / "publish")
    want, _ = load_published(ref / "publish")
    assert version == 3
    for key, value in want.model.state_dict().items():
        assert torch.equal(model.model.state_dict()[key], value), key
    # the histories carried with the last checkpoint: the stopped run's are the uninterrupted
    # one's, and those of the three partitions as one file (the quarantined one left out)
    d = recsys_dist.load_config(config).data
    whole = tmp_path / "whole"
    (whole / "all").mkdir(parents=True)
    log_rows = RAW.read_text().splitlines(keepends=True)[: 1 + 3 * PART_ROWS]
    (whole / "all" / "log.csv").write_text("".join(log_rows))
    one = d.model_copy(update={"stream": d.stream.model_copy(update={"path": str(whole)})})
    one_file = convert_partition(one, "all/log.csv", tmp_path / "parts").histories
    for r in (ref, run):
        got = load_histories(latest_checkpoint(r), d.schema.history)
        assert _flat(got) == _flat(one_file), r
    # served hot: the latest version scores a row of partition 3 with its user's whole history
    # (the log so far, as training carried it) as predict on its fold
    folded = tmp_path / "folded"
    cli(["export", "--from-publish", run / "publish", "--out", folded], tmp_path)
    rows_csv = tmp_path / "rows.csv"
    rows_csv.write_text("".join(log_rows))
    cli(["predict", folded, "--data", rows_csv, "--out", tmp_path / "p.parquet"], tmp_path)
    predicted = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()
    header, *lines = list(csv.reader(rows_csv.read_text().splitlines()))
    rows = [as_request(dict(zip(header, line))) for line in lines]
    with TestClient(create_app(ModelHolder(open_source(run / "publish"), 0))) as c:
        got = c.post("/score", json={"rows": rows}).json()
    assert got["version"] == 3
    np.testing.assert_allclose(got["logits"], predicted, rtol=0, atol=1e-6)


def _flat(state: dict) -> dict:
    """A history state (``UserHistory.state``) as plain lists, to compare."""
    return {u: ([list(c) for c in committed], at, pending) for u, (committed, at, pending) in state.items()}


def test_a_partitions_histories_carry_on_from_the_partitions_before(tmp_path):
    """data.stream.histories: carry (the default): user 8 rates 640 rows into the file, the
    last of partition 1 and the first of partition 2: that first row sees its 50 most recent
    events, the last of them partition 1's last row (on main its history was empty: each
    partition started afresh, which per_partition still does)."""
    config, landing = stream_config(tmp_path)
    d = recsys_dist.load_config(config).data
    carried, tables = None, []
    for name in PARTS[:2]:
        part = convert_partition(d, name, tmp_path / "parts", carried)
        carried = part.histories
        tables.append(pq.read_table(part.prepared.files["train"]))
    raw = [list(csv.DictReader((landing / name).read_text().splitlines())) for name in PARTS[:2]]
    assert raw[0][-1]["userId"] == raw[1][0]["userId"] == "8"
    movie = tables[0].column("movieId").to_pylist()
    first, second = (t.column("history").to_pylist() for t in tables)
    assert len(first[-1]) == 50 and second[0] == [*first[-1][1:], movie[-1]]
    assert second[1] == [*second[0][1:], tables[1].column("movieId")[0].as_py()]  # then its own rows
    fresh = recsys_dist.load_config(config, ["data.stream.histories=per_partition"]).data
    own = pq.read_table(convert_partition(fresh, PARTS[1], tmp_path / "parts").prepared.files["train"])
    assert own.column("history").to_pylist()[:2] == [[], [movie_id(own, 0)]]


def movie_id(table, i: int) -> int:
    return table.column("movieId")[i].as_py()


def test_a_partitions_actions_and_times_follow_its_history(tmp_path):
    """data.schema.history.action / times in the online conversion: per partition, each history
    event's rating (hashed like a categorical value) and its seconds before the row, raw (1 + s)."""
    config, landing = stream_config(tmp_path)
    d = recsys_dist.load_config(config, ["data.schema.history.action=rating", "data.schema.history.times=true"]).data
    t = pq.read_table(convert_partition(d, PARTS[0], tmp_path / "parts").prepared.files["train"])
    raw = list(csv.DictReader((landing / PARTS[0]).read_text().splitlines()))
    hist, actions, times = (t.column(c).to_pylist() for c in ("history", "history_action", "history_time"))
    i = max(range(len(raw)), key=lambda j: len(hist[j]))  # the longest history of the partition
    earlier = [r for r in raw[:i] if r["userId"] == raw[i]["userId"] and int(r["timestamp"]) < int(raw[i]["timestamp"])]
    earlier = earlier[-50:]
    assert len(hist[i]) == len(actions[i]) == len(times[i]) == len(earlier) > 10
    assert times[i] == [1 + int(raw[i]["timestamp"]) - int(r["timestamp"]) for r in earlier]
    by_rating = {}
    for r, a in zip(earlier, actions[i]):  # one id per rating value, distinct values distinct ids
        assert by_rating.setdefault(r["rating"], a) == a
    assert len(set(by_rating.values())) == len(by_rating) > 1
