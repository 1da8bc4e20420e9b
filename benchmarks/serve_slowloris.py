"""``recsys-dist serve`` under a slowloris: N connections each send a request line and then one
header line every 0.5 s, for ever; meanwhile one client POSTs 2 rows every 0.5 s on a new
connection. Prints that client's answers over time, how many slow connections the server still
holds at the end, and the server's log size.

Not a test (``tests/serving/test_limits.py`` checks the behaviour). Usage:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_slowloris.py EXPORT_DIR [--connections 1500] \\
        [--seconds 12] [--serve-args "--header-timeout 3"] [--pythonpath DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export", type=Path)
    p.add_argument("--connections", type=int, default=1500)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--serve-args", default="", help="more `recsys-dist serve` options")
    p.add_argument("--pythonpath", default=str(ROOT), help="where the server's recsys_dist comes from")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "recsys_dist.cli.main", "serve", str(args.export), "--port", str(port)]
    cmd += ["--reload-seconds", "0", *shlex.split(args.serve_args)]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    env = {**os.environ, "PYTHONPATH": args.pythonpath}
    # cwd: `python -m` puts it first on sys.path, ahead of PYTHONPATH
    proc = subprocess.Popen(cmd, env=env, cwd=args.pythonpath, stdout=subprocess.PIPE, stderr=log, text=True)
    slow = []
    try:
        proc.stdout.readline()  # printed once it listens
        for _ in range(args.connections):
            try:
                s = socket.create_connection(("127.0.0.1", port))
            except OSError as err:
                print(f"connection {len(slow) + 1} failed: {err}")
                break
            s.setblocking(False)
            s.send(b"POST /score HTTP/1.1\r\nHost: x\r\n")
            slow.append(s)
        body = json.dumps({"rows": SAMPLE.read_text().splitlines()[:2]})
        answers, t0 = [], time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            for s in slow:
                try:
                    s.send(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                c.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                r.read()
                answers.append((round(time.monotonic() - t0, 1), r.status))
                c.close()
            except OSError as err:
                answers.append((round(time.monotonic() - t0, 1), type(err).__name__))
            time.sleep(0.5)
        print(f"{len(slow)} slow connections; the other client's answers (seconds, status): {answers}")
        still_open = 0
        for s in slow:
            try:
                data = s.recv(65536)
                still_open += bool(data) and not data.startswith(b"HTTP/1.1 503")
            except BlockingIOError:
                still_open += 1
            except OSError:
                pass
        print(f"slow connections the server still held after {args.seconds:g} s: {still_open}")
    finally:
        for s in slow:
            s.close()
        proc.terminate()
        proc.wait(timeout=60)
    log.seek(0)
    text = log.read()
    print(f"server log: {len(text.splitlines())} lines, {len(text):,} bytes; first lines:")
    print("\n".join(text.splitlines()[:4]))


if __name__ == "__main__":
    main()
