"""configs/movielens_hstu.yaml with the time bias and action tokens (data.schema.history.times /
action, model.time_buckets / action_tokens) end to end: trained on 2 ranks, exported; ``predict``
on a user's history + candidates equals ``/score`` on the same rows as JSON objects (the
candidates without a rating: their own never enters a history; a rating 4 is the action 4.0);
the history's ratings and times
move the candidates' logits; the oldest of 60 events change nothing (the history keeps the last
50); a history out of time order is a 400 naming row and column."""

import csv
import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

from recsys_dist.serve.http import ModelHolder, create_app, open_source
from tests.cli import run_cli
from tests.conftest import ROOT
from tests.e2e.models.test_hstu_cli import RAW, as_request

HSTU = ROOT / "configs" / "movielens_hstu.yaml"
EXTRAS = [
    "data.schema.history.times=true",
    "model.time_buckets=128",
    "data.schema.history.action=rating",
    "model.action_tokens=true",
]


def cli(args, tmp):
    r = run_cli(args, tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def rows_to_score() -> tuple[list[str], list[dict], str]:
    """User 15's first 60 ratings, then 5 candidates at one later time (rating '3' in the file:
    predict reads a labelled file; it never reaches a history). Returns (header, rows, that time)."""
    lines = RAW.read_text().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, r)) for r in csv.reader(lines[1:])]
    user = [r for r in rows if r["userId"] == "15"][:60]
    later = str(int(user[-1]["timestamp"]) + 60)
    others = [r for r in rows if r["userId"] != "15"][:5]
    return header, user + [{**r, "userId": "15", "timestamp": later, "rating": "3"} for r in others], later


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hstu_with_time_bias_and_actions_trains_predicts_and_serves(tmp_path):
    run = tmp_path / "run"
    common = ["train.progress_bar=false", "train.max_steps=8", "eval.every_n_steps=4", "model.layer_dropout=0"]
    cli(["train", "--config", HSTU, "--run-dir", run, *common, *EXTRAS], tmp_path)
    export = tmp_path / "export"
    cli(["export", run, "--out", export], tmp_path)
    header, rows, later = rows_to_score()
    buf = io.StringIO()
    w = csv.DictWriter(buf, header, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    (tmp_path / "rows.csv").write_text(buf.getvalue())
    cli(["predict", export, "--data", tmp_path / "rows.csv", "--out", tmp_path / "p.parquet"], tmp_path)
    want = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()

    def request(r, rating=None):
        out = as_request(r)
        if r["timestamp"] == later:  # history rows carry their rating, candidates none
            del out["rating"]
        elif rating is not None:
            out["rating"] = float(rating)
        return out

    with TestClient(create_app(ModelHolder(open_source(export), 0))) as c:

        def score(objs):
            got = c.post("/score", json={"rows": objs})
            assert got.status_code == 200, got.text
            return np.array(got.json()["logits"])

        base = score([request(r) for r in rows])
        np.testing.assert_allclose(base, want, rtol=0, atol=1e-6)
        # a JSON client writes the rating 4.0 as 4: the same action (numbers keyed by value)
        as_ints = [request(r) for r in rows]
        for obj in as_ints:
            if float(obj.get("rating", 0.5)).is_integer():
                obj["rating"] = int(obj["rating"])
        assert any(isinstance(o.get("rating"), int) for o in as_ints)
        np.testing.assert_allclose(score(as_ints), base, rtol=0, atol=0)
        assert np.abs(score([request(r, rating=1.0) for r in rows])[-5:] - base[-5:]).min() > 1e-6
        shifted = [request(r) for r in rows]
        for obj in shifted[:-5]:  # every event a year earlier, the order kept: other time buckets
            obj["timestamp"] -= 365 * 86400
        assert np.abs(score(shifted)[-5:] - base[-5:]).min() > 1e-6
        np.testing.assert_allclose(score([request(r) for r in rows[10:]])[-5:], base[-5:], rtol=0, atol=1e-6)
        swapped = [request(r) for r in rows]
        swapped[2], swapped[3] = swapped[3], swapped[2]
        err = c.post("/score", json={"rows": swapped})
        assert err.status_code == 400 and "rows[3], column timestamp" in err.json()["error"], err.text
