"""``POST /score``'s in-memory route (``recsys_dist.serve.inmemory``) scores real shipped rows
as the file route (``serve.request_rows.score_rows``) and ``predict``'s own function
(``serve.export.score`` on the rows as a raw file) do, to 1e-6, per format and mapping:
criteo_tsv / hash, schema (dense, CSV) / hash, schema (multi-hot) / vocabulary, avazu_csv /
vocabulary with managed-collision features; missing values, unseen categories, odd and
negative dense values included; and a bad value is the file route's 400, word for word."""

import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from recsys_dist.data.formats.avazu import RAW_COLUMNS as AVAZU_COLUMNS
from recsys_dist.data.formats.criteo import COLUMNS as CRITEO_COLUMNS
from recsys_dist.errors import BadRequest
from recsys_dist.serve import request_rows as rows_module
from recsys_dist.serve.export import load, score
from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.inmemory import row_scorer
from recsys_dist.serve.request_rows import score_rows
from tests.conftest import CRITEO_SAMPLE, ROOT
from tests.e2e.serve.conftest import ONE_RANK, cli

AVAZU = ROOT / "datasets" / "avazu" / "avazu_train_first8999.csv"


def exported(tmp, run, name):
    out = tmp / name
    if not out.exists():
        cli(["export", run, "--out", out], tmp)
    return load(out)


def in_memory(loaded, rows, monkeypatch):
    """The in-memory scorer's logits, the file route switched off (it would raise)."""
    scorer = row_scorer(loaded)
    assert scorer.kind == "in-memory", getattr(scorer, "reason", None)
    with monkeypatch.context() as m:
        m.setattr(rows_module, "score", lambda *a, **k: pytest.fail("the file route was used"))
        return np.asarray(scorer(rows)["logits"])


def predicted(loaded, raw):
    """``predict``'s logits of the raw file ``raw`` (its function, in this process)."""
    return score(loaded.job, loaded.model, raw, preprocessing=loaded.preprocessing)["logit"]


def check_equal(loaded, objects, raw, monkeypatch, lines=None):
    fast = in_memory(loaded, objects, monkeypatch)
    want = predicted(loaded, raw)
    np.testing.assert_allclose(fast, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(score_rows(loaded, objects)["logits"], want, rtol=0, atol=1e-6)
    if lines is not None:
        np.testing.assert_allclose(in_memory(loaded, lines, monkeypatch), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(in_memory(loaded, objects[3:4], monkeypatch), want[3:4], rtol=0, atol=1e-6)
    assert np.std(want) > 1e-4  # the rows score differently: a wrong id would show
    return fast


def same_errors(loaded, cases):
    """Each bad request: the in-memory scorer's 400 is the file route's, naming the row and column."""
    scorer = row_scorer(loaded)
    for rows, expect in cases:
        with pytest.raises(BadRequest) as fast:
            scorer(rows)
        with pytest.raises(BadRequest) as slow:
            score_rows(loaded, rows)
        assert str(fast.value) == str(slow.value), (rows[-1], str(fast.value), str(slow.value))
        assert expect in str(fast.value), (expect, str(fast.value))


# ---------------------------------------------------------------- criteo_tsv, hash


def criteo_object(line: str) -> dict:
    row = {}
    for name, v in zip(CRITEO_COLUMNS[1:], line.split("\t")[1:]):
        if v != "":
            row[name] = int(v) if name[0] == "I" else v
    return row


def test_criteo_hash(criteo_run, tmp_path, monkeypatch):
    tmp, run = criteo_run
    loaded = exported(tmp, run, "inmemory_export")
    lines = CRITEO_SAMPLE.read_text().splitlines()[5000:5040]
    objects = [criteo_object(line) for line in lines]
    # odd values, each in the raw text predict reads: negative, signed, padded, zero-filled dense
    # values, a large one; unseen, upper-case and short hex ids; missing values every way
    odd = [
        ({"I1": -3, "I2": "+7", "I3": " 12 ", "I4": "007", "I5": 10**17, "C1": "DEADBEEF", "C2": "a"}, None),
        ({"I2": "-0", "I6": None, "I7": "", "C3": "0", "C4": "ffffffff", "C5": None, "C6": ""}, None),
        ({"I9": "999999999999999999", "C26": "1234abcd"}, None),
    ]
    for (change, _), k in zip(odd, (0, 1, 2)):
        objects[k] = {**{c: v for c, v in objects[k].items() if c not in change}, **change}
    raw_lines = [
        "\t".join("" if objects[i].get(c) is None else str(objects[i][c]) for c in CRITEO_COLUMNS[1:])
        for i in range(len(objects))
    ]
    (tmp_path / "rows.txt").write_text("\n".join(raw_lines) + "\n")
    check_equal(loaded, objects, tmp_path / "rows.txt", monkeypatch, lines=raw_lines)
    np.testing.assert_allclose(  # 40-field lines (label first), as the training file has them
        in_memory(loaded, lines, monkeypatch)[3:],
        predicted(loaded, tmp_path / "rows.txt")[3:],
        rtol=0,
        atol=1e-6,
    )
    good = objects[5]
    same_errors(
        loaded,
        [
            ([good, good, {**good, "C3": "zz"}], "rows[2], column C3: 'zz' is not an 8-digit hex id"),
            ([{**good, "I4": "1.5"}], "rows[0], column I4: '1.5' is not an integer"),
            ([good, {**good, "I5": 1.5}], "rows[1], column I5: '1.5' is not an integer"),
            ([{**good, "I1": 10**30}], "rows[0], column I1: '1000000000000000000000000000000' is not an integer"),
            ([{**good, "C1": "123456789"}], "rows[0], column C1: '123456789' is not an 8-digit hex id"),
            ([{**good, "I2": True}], "rows[0], column I2: a boolean is not a value"),
            ([good, {**good, "C27": "00"}], "rows[1]: unknown column 'C27'"),
            ([{**good, "C2": "a\tb"}], "rows[0], column C2: a value may not hold a line break or a tab"),
            ([{**good, "I3": "5"}, {**good, "I2": [1]}], "rows[1], column I2: a list is not a value"),
            ([lines[0], "1\t2"], "rows[1]: expected 40 fields, got 2"),
        ],
    )
    with TestClient(create_app(ModelHolder(open_source(tmp / "inmemory_export"), 0))) as c:
        assert c.get("/health").json()["scoring"] == "in-memory"
        r = c.post("/score", content=json.dumps({"rows": [good, {**good, "C3": "zz"}]}).encode())
        assert r.status_code == 400 and r.json()["error"].startswith("rows[1], column C3: 'zz'"), r.text


# ---------------------------------------------------------------- schema (dense), hash


def test_schema_dense_hash(schema_run, tmp_path, monkeypatch):
    tmp, run = schema_run
    loaded = exported(tmp, run, "inmemory_export")
    lines = (tmp / "data.csv").read_text().splitlines()[1:41]
    objects = []
    for line in lines:
        _, d1, d2, c1, c2 = line.split(",")
        objects.append({"d1": float(d1), "d2": d2, "c1": int(c1), "c2": c2})
    objects[0].update(d1=-5.5, d2="1e3", c1=987654)  # negative dense, exponent, an unseen category
    objects[1].update(d1=" 2.5 ", d2=None, c2="")  # spaces, missing values
    objects[2].update(d1=1e300, d2="+3", c1="x y")  # huge (finite after log1p), signed, text category
    raw = ["d1,d2,c1,c2"] + [
        ",".join("" if o.get(c) is None else repr(o[c]) if isinstance(o[c], float) else str(o[c]) for c in o)
        for o in objects
    ]
    (tmp_path / "rows.csv").write_text("\n".join(raw) + "\n")
    check_equal(loaded, objects, tmp_path / "rows.csv", monkeypatch)
    good = objects[5]
    same_errors(
        loaded,
        [
            ([good, {**good, "d1": "x"}], "rows[1], column d1: 'x' is not a number"),
            ([{**good, "d2": "nan"}], "rows[0], column d2: 'nan' is not a finite number"),
            ([{**good, "d1": float("inf")}], "rows[0], column d1: inf is not a finite number"),
            ([{**good, "c3": 1}], "rows[0]: unknown column 'c3'"),
        ],
    )


# ---------------------------------------------------------------- schema (multi-hot), vocabulary


def test_movielens_vocabulary_multi_hot(movielens_run, tmp_path, monkeypatch):
    tmp, run, _, rows_file = movielens_run
    loaded = exported(tmp, run, "inmemory_export")
    header, *lines = rows_file.read_text().splitlines()
    picked = lines[380:420]  # 20 rows the model trained on, 20 it never saw
    objects = []
    for line in picked:
        user, movie, _, _, genres = line.split(",")
        objects.append({"userId": int(user), "movieId": movie, "genres": genres})
    objects[0].update(genres=objects[0]["genres"].split("|"))  # a JSON list
    objects[1].update(userId=99999999, movieId="no such movie", genres=["Drama", "", "Nope"])  # unseen, empty
    objects[2].update(genres=None, movieId=None)  # missing values
    objects[4].update(genres=" Drama | Comedy ")  # spaces around elements

    def text(o, c):
        v = o.get(c)
        return "" if v is None else "|".join(v) if isinstance(v, list) else str(v)

    raw = ["userId,movieId,genres"] + [",".join(text(o, c) for c in ("userId", "movieId", "genres")) for o in objects]
    (tmp_path / "rows.csv").write_text("\n".join(raw) + "\n")
    check_equal(loaded, objects, tmp_path / "rows.csv", monkeypatch)
    same_errors(loaded, [([objects[3], {**objects[3], "genres": [{"a": 1}]}], "rows[1], column genres: an object")])


# ---------------------------------------------------------------- avazu_csv, vocabulary + managed


@pytest.fixture(scope="module")
def avazu_run(tmp_path_factory):
    """DeepFM on the first 2,000 Avazu rows, 6 steps: vocabulary mapping, and managed-collision
    tables for three features (admitted after every step)."""
    tmp = tmp_path_factory.mktemp("avazu")
    run = tmp / "run"
    cli(
        ["train", "--config", ROOT / "configs/avazu_vocabulary.yaml", "--run-dir", run, *ONE_RANK]
        + ["data.num_rows=2000", "train.max_steps=6", "train.batch_size=64", "data.managed.eviction_interval=1"]
        + ["data.managed.features=[site_id,device_model,C14]"],
        tmp,
    )
    return tmp, run


def test_avazu_vocabulary_managed(avazu_run, tmp_path, monkeypatch):
    tmp, run = avazu_run
    loaded = exported(tmp, run, "inmemory_export")
    header, *lines = AVAZU.read_text().splitlines()
    picked = lines[:20] + lines[8000:8020]  # trained on (ids admitted, in the vocabulary), and unseen rows
    objects = [dict(zip(AVAZU_COLUMNS, line.split(","))) for line in picked]
    for o in objects[20:]:
        del o["id"], o["click"]  # optional
    objects[1].update(site_id="never seen", device_model='a"b', C14=None)  # unseen, a quote, missing
    objects[2].update(C1=1005, C15="", app_id=None)

    def text(o, c):
        v = o.get(c)
        return (str(v) if v else "0") if c in ("id", "click") else "" if v is None else str(v)

    (tmp_path / "rows.csv").write_text(
        "\n".join([header] + [",".join(text(o, c) for c in AVAZU_COLUMNS) for o in objects]) + "\n"
    )
    check_equal(loaded, objects, tmp_path / "rows.csv", monkeypatch)
    good = objects[5]
    same_errors(
        loaded,
        [
            ([good, {**good, "hour": "14109999"}], "rows[1], column hour: '14109999'"),
            ([{**good, "hour": None}], "rows[0], column hour: ''"),
            ([{**good, "site_id": "a,b"}], "rows[0], column site_id: a value may not hold a line break or a comma"),
        ],
    )
