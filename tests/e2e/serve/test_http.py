"""``recsys-dist serve``: POST /score equals ``recsys-dist predict`` on the same rows, bad
requests are 400s naming the row and column, /health, and a hot reload under a burst of
concurrent requests (no request fails; each is scored wholly by the version it names)."""

import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from safetensors.torch import load_file, save_file
from starlette.testclient import TestClient

from recsys_dist.data.formats.criteo import COLUMNS
from recsys_dist.serve.export import load
from recsys_dist.serve.http import ModelHolder, PublishSource, create_app, open_source
from recsys_dist.serve.limits import Limits
from recsys_dist.serve.request_rows import score_rows
from tests.conftest import ROOT
from tests.e2e.serve.conftest import HTTP_LINES as LINES
from tests.e2e.serve.conftest import cli, predictions


def as_object(line: str, label: bool = True) -> dict:
    """A raw line as a JSON row: integers as numbers, empty fields as null or left out."""
    row = {}
    for i, (name, v) in enumerate(zip(COLUMNS, line.split("\t"))):
        if name == "label" and not label:
            continue
        if v == "":
            if i % 2:  # both spellings of a missing value
                row[name] = None
            continue
        row[name] = int(v) if name[0] in "lI" else v
    return row


def test_scores_equal_predict(export_dir, predicted):
    logit, prob = predicted
    with TestClient(create_app(ModelHolder(open_source(export_dir), 0))) as c:
        bodies = {
            "objects": [as_object(line) for line in LINES],
            "objects without label": [as_object(line, label=False) for line in LINES],
            "lines": LINES,
            "unlabelled lines": [line.split("\t", 1)[1] for line in LINES],
        }
        for what, rows in bodies.items():
            r = c.post("/score", json={"rows": rows})
            assert r.status_code == 200, (what, r.text)
            got = r.json()
            assert got["version"] == 1 and got["model"] == f"export {export_dir}"
            np.testing.assert_allclose(got["logits"], logit, rtol=0, atol=1e-6, err_msg=what)
            np.testing.assert_allclose(got["scores"], prob, rtol=0, atol=1e-6, err_msg=what)
        one = c.post("/score", json={"rows": [as_object(LINES[7])]}).json()  # batch 1: the same row's score
        assert abs(one["logits"][0] - logit[7]) <= 1e-6
        h = c.get("/health")
        assert h.status_code == 200
        assert h.json()["status"] == "ok" and h.json()["version"] == 1
        assert h.json()["source"] == f"export {export_dir}" and h.json()["loaded_at"].endswith("+00:00")


def test_bad_requests_are_400s_naming_row_and_column(export_dir):
    good = as_object(LINES[0])
    cases = [
        (b"{not json", "the body is not JSON"),
        (json.dumps([1, 2]).encode(), 'the body must be a JSON object {"rows"'),
        (json.dumps({"row": [good]}).encode(), 'the body must be a JSON object {"rows"'),
        (json.dumps({"rows": []}).encode(), '"rows" must be a non-empty list of rows, got an empty list'),
        (json.dumps({"rows": [good], "x": 1}).encode(), "unknown key 'x'"),
        (json.dumps({"rows": [good, {**good, "C27": "00"}]}).encode(), "rows[1]: unknown column 'C27'"),
        (json.dumps({"rows": [good, good, {**good, "C3": "zz"}]}).encode(), "rows[2], column C3: 'zz' is not"),
        (json.dumps({"rows": [{**good, "I4": "1.5"}]}).encode(), "rows[0], column I4: '1.5' is not an integer"),
        (json.dumps({"rows": [{**good, "I2": [1]}]}).encode(), "rows[0], column I2: a list is not a value"),
        (json.dumps({"rows": [{**good, "I2": True}]}).encode(), "rows[0], column I2: a boolean is not a value"),
        (json.dumps({"rows": [good, LINES[1]]}).encode(), "not a mix"),
        (json.dumps({"rows": [LINES[0], "1\t2"]}).encode(), "rows[1]: expected 40 fields, got 2"),
        (json.dumps({"rows": [3]}).encode(), "rows[0]: a number; a row is an object"),
        # Non-ASCII in a hex column, and a lone surrogate escape: were 500s (ValueError, UnicodeEncodeError).
        (json.dumps({"rows": [{**good, "C3": "\u00e9\u00e9\u00e9"}]}).encode(), "rows[0], column C3: 'ééé' is not"),
        (b'{"rows": [{"C3": "\\ud800"}]}', "a lone surrogate"),
        (b'{"rows": ["\\ud800"]}', "a lone surrogate"),
    ]
    with TestClient(create_app(ModelHolder(open_source(export_dir), 0))) as c:
        for body, message in cases:
            r = c.post("/score", content=body)
            assert r.status_code == 400, (body[:80], r.text)
            assert message in r.json()["error"], (message, r.json())
        assert c.get("/score").status_code == 405
        assert c.post("/score", json={"rows": [good]}).status_code == 200  # still serving


def _write_weights(state: dict, path):
    """Write weights as a publisher would: a temporary file renamed over the served one."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path)


def test_hot_reload_under_concurrent_requests(export_dir, tmp_path, caplog):
    served = tmp_path / "export"
    shutil.copytree(export_dir, served)
    weights = served / "model.safetensors"
    v1 = load_file(str(weights))
    v2 = {k: v * 1.5 if v.is_floating_point() else v for k, v in v1.items()}  # other scores everywhere
    rows = [as_object(line) for line in LINES[:8]]
    expected = {1: score_rows(load(export_dir), rows)["logits"]}
    holder = ModelHolder(open_source(served), reload_seconds=0.05)
    results, errors, stop = [], [], threading.Event()

    def client(c):
        while not stop.is_set():
            r = c.post("/score", json={"rows": rows})
            (results if r.status_code == 200 else errors).append(r.json() if r.status_code == 200 else r.text)

    with caplog.at_level(logging.WARNING, logger="recsys_dist.serve"), TestClient(create_app(holder)) as c:
        threads = [threading.Thread(target=client, args=(c,)) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        _write_weights(v2, weights)
        _wait(lambda: c.get("/health").json()["version"] == 2)
        expected[2] = score_rows(holder.current.loaded, rows)["logits"]
        time.sleep(0.5)
        weights.with_name("damaged").write_bytes(b"\x00" * 64)  # a damaged file: refused, v2 keeps serving
        os.replace(weights.with_name("damaged"), weights)
        _wait(lambda: "reloading" in caplog.text)
        time.sleep(0.3)
        assert c.get("/health").json()["version"] == 2
        _write_weights(v1, weights)
        _wait(lambda: c.get("/health").json()["version"] == 3)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
    expected[3] = expected[1]
    assert not errors, errors[:3]
    versions = [r["version"] for r in results]
    assert {1, 2, 3} <= set(versions), sorted(set(versions))
    for r in results:  # each response wholly scored by the model it names
        np.testing.assert_allclose(r["logits"], expected[r["version"]], rtol=0, atol=1e-6)
    assert not np.allclose(expected[1], expected[2])
    assert "reloading export" in caplog.text and "still serving version 2" in caplog.text


def _wait(cond, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_source_errors(tmp_path, export_dir):
    with pytest.raises(Exception, match="neither an export directory"):
        open_source(tmp_path)
    with pytest.raises(Exception, match="does not exist"):
        open_source(tmp_path / "nope")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a run directory: not 'export into it'
    with pytest.raises(Exception, match=r"is a training run's directory: serve its publish directory .*run/publish"):
        open_source(tmp_path / "run")


def test_export_files_have_the_mode_of_a_plain_open(export_dir):
    """safetensors writes 0600; an export's weights must be as readable as its other files (a
    server running as another user): ``files.write_atomic`` gives every file 0666 less the umask
    (the test's process and the exporting CLI share it)."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in export_dir.iterdir() if p.is_file()}
    assert "model.safetensors" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_cli_serves_and_stops_on_sigterm(export_dir, predicted):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "recsys_dist.cli.main", "serve", str(export_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        line = proc.stdout.readline()  # printed once listening: /health answers at once, no retry
        health = json.loads(urllib.request.urlopen(f"{url}/health", timeout=5).read())
        assert health["status"] == "ok" and health["version"] == 1
        req = urllib.request.Request(
            f"{url}/score", data=json.dumps({"rows": LINES[:3]}).encode(), headers={"Content-Type": "application/json"}
        )
        got = json.loads(urllib.request.urlopen(req, timeout=30).read())
        np.testing.assert_allclose(got["logits"], predicted[0][:3], rtol=0, atol=1e-6)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert line == (
        f"recsys-dist: serving export {export_dir} version 1 (in-memory scoring) on {url} "
        "(POST /score, GET /health; reload every 2 s)\n"
    )


def test_publish_source_serves_the_latest_version(export_dir, tmp_path):
    """The publish adapter (recsys_dist.serve.publish's latest_version / load_published,
    stood in for here): the served version is the published one, and follows ``latest``."""

    class Api:
        latest = 4
        asked = []

        @staticmethod
        def latest_version(path):
            return Api.latest

        @staticmethod
        def load_published(path, version=None):
            Api.asked.append(version)
            return load(export_dir), version

    holder = ModelHolder(PublishSource(tmp_path, Api), reload_seconds=0)
    assert holder.current.version == 4 and not holder.poll()
    Api.latest = 6
    assert holder.poll() and holder.current.version == 6 and Api.asked == [4, 6]
    with TestClient(create_app(holder)) as c:
        assert c.post("/score", json={"rows": LINES[:2]}).json()["version"] == 6


def test_schema_rows_equal_predict(schema_run):
    """format: schema (trained on Parquet, rows sent as objects of its columns): predict's scores."""
    tmp, run = schema_run
    export = tmp / "http_export"
    cli(["export", run, "--out", export], tmp)
    lines = (tmp / "data.csv").read_text().splitlines()
    (tmp / "rows.csv").write_text("\n".join([lines[0], *lines[1:41]]) + "\n")
    cli(["predict", export, "--data", tmp / "rows.csv", "--out", tmp / "schema_p.parquet"], tmp)
    want = predictions(tmp / "schema_p.parquet").column("logit").to_numpy()
    header = lines[0].split(",")
    rows = [dict(zip(header, line.split(","))) for line in lines[1:41]]
    rows = [{k: (float(v) if k[0] == "d" else int(v) if k[0] == "c" else v) for k, v in r.items()} for r in rows]
    with TestClient(create_app(ModelHolder(open_source(export), 0))) as c:
        got = c.post("/score", json={"rows": rows}).json()
        np.testing.assert_allclose(got["logits"], want, rtol=0, atol=1e-6)
        r = c.post("/score", json={"rows": [{**rows[0], "d1": "x"}]})
        assert r.status_code == 400 and "rows[0]" in r.json()["error"] and "d1" in r.json()["error"], r.text


def test_a_body_over_the_limit_is_refused_unread(export_dir):
    rows = [as_object(line) for line in LINES[:20]]  # ~10 KB of JSON
    with TestClient(create_app(ModelHolder(open_source(export_dir), 0), Limits(max_body_bytes=2000))) as c:
        r = c.post("/score", json={"rows": rows})
        assert r.status_code == 413 and "send fewer rows per request" in r.json()["error"], r.text
        assert "over this server's limit of 2,000 bytes per request" in r.json()["error"]
        assert r.headers["connection"] == "close"
        chunks = (b'{"rows": [' + b",".join(json.dumps(x).encode() for x in rows) + b"]}" for _ in range(1))
        r = c.post("/score", content=chunks)  # streamed, no Content-Length: cut off while reading
        assert r.status_code == 413, r.text
        assert c.post("/score", json={"rows": rows[:2]}).status_code == 200  # still serving
