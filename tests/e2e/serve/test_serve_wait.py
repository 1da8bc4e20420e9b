"""``recsys-dist serve --wait``: a directory without a model yet is served in a waiting state
(503s), then the model that appears there (a publish or an export) is served, scored as
``recsys-dist predict`` scores the same rows; the command's startup line is printed once it
listens and names the version once; a taken port is one line and exit 2."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from starlette.testclient import TestClient

from recsys_dist.cli.serve import startup_line
from recsys_dist.errors import ConfigError
from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.publish import Publisher
from recsys_dist.train.config import PublishConfig
from tests.conftest import ROOT
from tests.e2e.serve.conftest import HTTP_LINES as LINES
from tests.e2e.serve.test_http import _wait

WAITING = "no model yet: waiting for {} to hold an export or a publish (manifest.json)"


def _assert_waiting(c, d):
    h = c.get("/health")
    assert h.status_code == 503 and h.json() == {"status": "waiting", "source": str(d), "version": None}
    r = c.post("/score", json={"rows": LINES[:2]})
    assert r.status_code == 503 and r.json() == {"error": WAITING.format(d)}


def test_waits_for_a_publish_then_serves_it_and_follows_its_versions(criteo_run, predicted, tmp_path):
    _, run = criteo_run
    d = tmp_path / "publish"
    d.mkdir()  # a run's publish dir before its first publish: empty
    with pytest.raises(ConfigError, match="neither an export directory.*--wait"):
        open_source(d)
    holder = ModelHolder(open_source(d, wait=True), reload_seconds=0.05)
    assert holder.current is None
    with TestClient(create_app(holder)) as c:
        _assert_waiting(c, d)
        time.sleep(0.2)  # a few polls of the empty directory: still waiting
        _assert_waiting(c, d)
        p = Publisher(d, PublishConfig(enabled=True, every_partition=True))
        p.publish(run)  # version 1: the run's final checkpoint, the one `export` wrote
        _wait(lambda: c.get("/health").status_code == 200)
        h = c.get("/health").json()
        assert h["status"] == "ok" and h["version"] == 1 and h["source"].startswith(f"publish {d} version 1")
        got = c.post("/score", json={"rows": LINES}).json()
        assert got["version"] == 1
        np.testing.assert_allclose(got["logits"], predicted[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got["scores"], predicted[1], rtol=0, atol=1e-6)
        p.publish(run)  # version 2 (a delta): followed
        _wait(lambda: c.get("/health").json()["version"] == 2)
        got = c.post("/score", json={"rows": LINES[:5]}).json()
        assert got["version"] == 2
        np.testing.assert_allclose(got["logits"], predicted[0][:5], rtol=0, atol=1e-6)
    assert holder.describe() == f"publish {d} version 2 (in-memory scoring)"


def test_waits_for_an_export_in_a_directory_not_there_yet(export_dir, predicted, tmp_path):
    d = tmp_path / "not" / "yet"
    with pytest.raises(ConfigError, match="does not exist.*recsys-dist export RUN --out.*--wait"):
        open_source(d)
    holder = ModelHolder(open_source(d, wait=True), reload_seconds=0.05)
    with TestClient(create_app(holder)) as c:
        _assert_waiting(c, d)
        staging = tmp_path / "staging"
        shutil.copytree(export_dir, staging)
        d.parent.mkdir()
        os.replace(staging, d)  # the export appears at once, by rename
        _wait(lambda: c.get("/health").status_code == 200)
        assert c.get("/health").json()["source"] == f"export {d}"
        got = c.post("/score", json={"rows": LINES}).json()
        assert got["version"] == 1 and got["model"] == f"export {d}"
        np.testing.assert_allclose(got["logits"], predicted[0], rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="is a file"):
        open_source(d / "model.safetensors", wait=True)


def test_startup_line_names_the_version_once(export_dir, criteo_run, tmp_path):
    url = "http://127.0.0.1:8000"
    holder = ModelHolder(open_source(export_dir), 0)
    assert startup_line(holder, url, 2.0) == (
        f"recsys-dist: serving export {export_dir} version 1 (in-memory scoring) on {url} "
        "(POST /score, GET /health; reload every 2 s)"
    )
    d = tmp_path / "pub"
    p = Publisher(d, PublishConfig(enabled=True, every_partition=True))
    p.publish(criteo_run[1]), p.publish(criteo_run[1])
    line = startup_line(ModelHolder(open_source(d), 1), url, 1.0)
    assert line == (
        f"recsys-dist: serving publish {d} version 2 (in-memory scoring) on {url} "
        "(POST /score, GET /health; reload every 1 s)"
    )
    assert line.count("version") == 1
    waiting = startup_line(ModelHolder(open_source(tmp_path / "w", wait=True), 1), url, 1.0)
    assert waiting == (
        f"recsys-dist: listening on {url} with no model yet, waiting for {tmp_path / 'w'} to hold an export "
        "or a publish (manifest.json); 503 until it appears (POST /score, GET /health; reload every 1 s)"
    )


def _serve(args, tmp):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "recsys_dist.cli.main", "serve", *map(str, args)]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_port_taken_is_one_line_and_the_line_comes_once_listening(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _serve([tmp_path / "pub", "--wait", "--port", port, "--reload-seconds", "0.2"], tmp_path)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"port {port} on 127.0.0.1 is already in use; give another --port, or stop what holds it" in err

    # --port 0: the system picks one; the line names it, and it answers as soon as the line is read
    proc = _serve([tmp_path / "pub", "--wait", "--port", 0, "--reload-seconds", "0.2"], tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("recsys-dist: listening on http://127.0.0.1:"), (line, proc.stderr.read())
        url = line.split()[3]
        with pytest.raises(urllib.error.HTTPError) as health:  # no retry: it listens already
            urllib.request.urlopen(f"{url}/health", timeout=10)
        assert health.value.code == 503 and json.loads(health.value.read())["status"] == "waiting"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
