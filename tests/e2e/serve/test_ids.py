"""Ids sent to ``POST /score`` as JSON numbers: an integral float maps to the integer's id in a
column trained from integers (it was hashed as the text "100370.0": another id, another score),
anything else that is no id is a 400 naming the column; a column of the training file the
model does not use (a timestamp) is accepted and ignored, as ``predict`` ignores it in a file."""

import json
import shutil

import numpy as np
import pytest
from starlette.testclient import TestClient

from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.request_rows import MAX_LIST_ELEMENTS, score_rows
from tests.e2e.serve.conftest import cli


@pytest.fixture(scope="module")
def movielens_export(movielens_run):
    """The MovieLens DeepFM's export (vocabulary mapping; ids userId, movieId; genres a
    multi-hot text column) and 20 raw rows (userId, movieId, rating, timestamp, genres)."""
    tmp, run, _, rows = movielens_run
    export = tmp / "ids_export"
    if not export.exists():
        cli(["export", run, "--out", export], tmp)
    header, *lines = rows.read_text().splitlines()
    return export, [dict(zip(header.split(","), line.split(","))) for line in lines[:20]]


def _rows(raw, user=int, movie=int, **extra):
    return [{"userId": user(r["userId"]), "movieId": movie(r["movieId"]), "genres": r["genres"], **extra} for r in raw]


def _logits(c, rows):
    r = c.post("/score", json={"rows": rows})
    assert r.status_code == 200, r.text
    return np.array(r.json()["logits"])


def test_float_ids_score_as_the_integer_and_unused_columns_are_ignored(movielens_export):
    export, raw = movielens_export
    record = json.loads((export / "preprocessing.json").read_text())
    assert record["raw_columns"] == ["userId", "movieId", "rating", "timestamp", "genres"]
    assert record["integer_columns"] == ["userId", "movieId"]
    holder = ModelHolder(open_source(export), 0)
    assert holder.current.scorer.kind == "in-memory"
    with TestClient(create_app(holder)) as c:
        ints = _logits(c, _rows(raw))
        floats = _logits(c, _rows(raw, float, float))
        np.testing.assert_array_equal(floats, ints)
        # the raw file's other columns, as a row of it holds them: accepted, ignored
        full = [
            {**row, "timestamp": int(r["timestamp"]), "rating": float(r["rating"])} for row, r in zip(_rows(raw), raw)
        ]
        np.testing.assert_array_equal(_logits(c, full), ints)
        np.testing.assert_array_equal(_logits(c, _rows(raw, str, str)), ints)
        # what a float was mapped to before: the text "31.0", another id (out of the vocabulary)
        as_text = _logits(c, _rows(raw, lambda v: f"{v}.0", lambda v: f"{v}.0"))
        assert not np.allclose(as_text, ints)
    # the file route (a model the in-memory route does not cover) maps them the same
    np.testing.assert_array_equal(score_rows(holder.current.loaded, _rows(raw, float, float))["logits"], ints)


def test_values_that_are_no_ids_are_400s_naming_the_column(movielens_export):
    export, raw = movielens_export
    good = _rows(raw)[0]
    cases = [
        ({**good, "userId": 1.5}, "rows[0], column userId: 1.5 is not an id; send an id as a string or an integer"),
        ({**good, "movieId": 2.0**60}, "rows[0], column movieId: 1.152921504606847e+18 is past 2^53"),
        ({**good, "userId": True}, "rows[0], column userId: a boolean is not a value"),
        ({**good, "userId": [1]}, "rows[0], column userId: a list is not a value"),
        ({**good, "movieId": {"id": 1}}, "rows[0], column movieId: an object is not a value"),
        (
            {**good, "genres": ["Drama", 2.0]},
            "rows[0], column genres: 2.0 is a float, and the column's training ids were not all integers",
        ),
        ({**good, "genres": [["Drama"]]}, "rows[0], column genres: a list is not a list element"),
        (
            {**good, "tsx": 1},
            "rows[0]: unknown column 'tsx' for format schema (its columns: rating, userId, movieId, genres (read and ignored: timestamp))",
        ),
    ]
    with TestClient(create_app(ModelHolder(open_source(export), 0))) as c:
        for row, message in cases:
            r = c.post("/score", json={"rows": [good, row]})
            assert r.status_code == 400, (row, r.text)
            assert message.replace("rows[0]", "rows[1]") in r.json()["error"], (message, r.json())


def test_a_record_without_the_training_columns_refuses_floats(movielens_export, tmp_path):
    """An export from before the record kept them: a float id cannot be mapped for sure."""
    export, raw = movielens_export
    old = tmp_path / "old_export"
    shutil.copytree(export, old)
    record = json.loads((old / "preprocessing.json").read_text())
    del record["raw_columns"], record["integer_columns"]
    (old / "preprocessing.json").write_text(json.dumps(record))
    with TestClient(create_app(ModelHolder(open_source(old), 0))) as c:
        r = c.post("/score", json={"rows": _rows(raw[:1], float)})
        assert r.status_code == 400 and "does not say whether the column's training ids were integers" in r.text
        r = c.post("/score", json={"rows": [{**_rows(raw[:1])[0], "timestamp": 1}]})
        assert r.status_code == 400 and "unknown column 'timestamp'" in r.text
        assert c.post("/score", json={"rows": _rows(raw[:1])}).status_code == 200


def test_a_list_over_the_element_limit_is_a_400_naming_the_limit(movielens_export):
    export, raw = movielens_export
    good = _rows(raw)[0]
    with TestClient(create_app(ModelHolder(open_source(export), 0))) as c:
        genres = good["genres"].split("|")
        assert c.post("/score", json={"rows": [{**good, "genres": genres}]}).status_code == 200
        r = c.post("/score", json={"rows": [good, {**good, "genres": ["Drama"] * (MAX_LIST_ELEMENTS + 1)}]})
        assert r.status_code == 400, r.text
        assert (
            f"rows[1], column genres: a list of {MAX_LIST_ELEMENTS + 1:,} elements, over the limit of "
            f"{MAX_LIST_ELEMENTS:,} per list value"
        ) in r.json()["error"], r.json()
