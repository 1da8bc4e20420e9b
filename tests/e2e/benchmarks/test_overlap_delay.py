"""benchmarks/overlap_delay.py --netns without training: the tc commands it builds
(benchmarks/netns.py), its refusals (no unshare, a kernel that refuses the namespace, shaping
outside a namespace of its own; options without --netns, through its command line), and one real
unprivileged namespace whose capped loopback carries a TCP transfer (skipped, with the reason,
where the kernel refuses it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks import netns as od
from tests.conftest import ROOT
from tests.unit.benchmarks.test_overlap_delay import SCRIPT, _which_but


def overlap_delay(*argv: str) -> subprocess.CompletedProcess:
    """``python benchmarks/overlap_delay.py ARGV`` from the repository root."""
    cmd = [sys.executable, "benchmarks/overlap_delay.py", *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=False)


BAD_ARGUMENTS = [
    (["--netns"], "--netns needs --rate-mbit"),
    (["--netns", "--rate-mbit", "0"], "--netns needs --rate-mbit"),
    (["--rate-mbit", "100"], "apply only with --netns"),
    (["--shaper", "tbf"], "apply only with --netns"),
    (["--delays", "-2"], "--delays must be finite numbers >= 0"),
    (["--delays", "nan"], "--delays must be finite numbers >= 0"),
    (["--delays", "inf"], "--delays must be finite numbers >= 0"),
    (["--delays", "2", "2.0"], "--delays has a repeated value"),
    (["--steps", "5"], "--steps must be >= 20"),
    (["--reps", "0"], "--reps must be >= 1"),
]


def test_bad_arguments_are_refused_before_any_rank_starts():
    for argv, words in BAD_ARGUMENTS:
        done = overlap_delay(*argv)
        assert done.returncode == 2 and words in done.stderr, (argv, done.stderr)


def test_refuses_when_the_namespace_is_refused(monkeypatch):
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` command")
    _which_but(monkeypatch, "unshare", false)  # an unshare that fails, as a kernel without user namespaces makes it
    with pytest.raises(SystemExit) as info:
        od.reexec_in_netns(SCRIPT, ["--netns", "--rate-mbit", "100", "--delays", "0"], 100)
    msg = str(info.value.code)
    assert "refused an unprivileged user+network namespace" in msg and "no run without the cap" in msg, msg


def test_never_shapes_the_machines_own_interfaces(monkeypatch):
    if od.tool("ip") is None:
        pytest.skip("no ip command")
    if od.interfaces() == ["lo"]:
        pytest.skip("this process already sees lo alone")
    ran = []
    real_run = od.run_cmd
    monkeypatch.setattr(od, "run_cmd", lambda cmd: ran.append(cmd) or real_run(cmd))
    with pytest.raises(SystemExit, match="refusing to shape"):
        od.setup_netns(100, "auto", [0.0])
    assert ran == [["ip", "-o", "link", "show"]]  # looked, changed nothing


SEND = 200_000
CHILD = f"""
import json, socket, threading
from benchmarks import netns as od
shaper = od.setup_netns(8, "tbf", [0.0])
srv = socket.create_server(("127.0.0.1", 0))
got = []
def receive():
    conn, _ = srv.accept()
    n = 0
    while chunk := conn.recv(65536):
        n += len(chunk)
    got.append(n)
t = threading.Thread(target=receive)
t.start()
with socket.create_connection(srv.getsockname()) as s:
    s.sendall(b"x" * {SEND})
t.join()
print(json.dumps({{"shaper": shaper, "received": got[0], "interfaces": od.interfaces(), **od.qdisc_stats()[1]}}))
"""


def test_real_namespace_caps_its_loopback():
    """The benchmark's own setup in a real ``unshare --user --map-root-user --net``: lo alone,
    the tbf command printed, and the qdisc counts the bytes of a TCP transfer over 127.0.0.1
    and held packets back (overlimits) without dropping any."""
    missing = [n for n in ("unshare", "ip", "tc") if od.tool(n) is None]
    if missing:
        pytest.skip(f"{missing} not installed")
    problem = od.probe_netns(8)
    if problem:
        pytest.skip(f"the kernel refuses an unprivileged namespace with tbf here: {problem}")
    cmd = [od.tool("unshare"), "--user", "--map-root-user", "--net", "--", sys.executable, "-c", CHILD]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "netns: tc qdisc add dev lo root tbf rate 8mbit burst 15000 limit 1048576" in lines, lines
    stats = json.loads(lines[-1])
    assert stats["shaper"] == "tbf" and stats["interfaces"] == ["lo"] and stats["received"] == SEND
    assert stats["bytes"] > SEND and stats["overlimits"] > 0 and stats["dropped"] == 0, stats
