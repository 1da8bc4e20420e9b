"""``recsys-dist serve`` under a slowloris: N connections each send a request line and then one
header line every 0.5 s, for ever; meanwhile one client POSTs 2 rows every 0.5 s on a new
connection. Prints that client's answers over time, how many slow connections the server still
holds at the end, and the server's log size.

Not a test (``tests/e2e/serve/test_limits.py`` checks the behaviour). Usage:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_slowloris.py EXPORT_DIR [--connections 1500] \\
        [--seconds 12] [--serve-args "--header-timeout 3"] [--pythonpath DIR]
"""

from __future__ import annotations

import http.client
import json
import shlex
import socket
import subprocess
import tempfile
import time

import harness
import servers


def main(argv: list[str] | None = None) -> None:
    p = servers.add_server_args(harness.parser(__doc__, "serve_slowloris", "20 slow connections for 2 s"))
    p.add_argument("--connections", type=int, default=1500)
    p.add_argument("--seconds", type=float, default=12.0)
    args = p.parse_args(argv)
    if args.smoke:
        args.connections, args.seconds = 20, 2.0
    with harness.Results(args, argv):
        slowloris(args)


def slowloris(args) -> None:
    """Start the server, hold the slow connections, let the other client post; print what it met."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    slow = []
    serve_args = shlex.split(args.serve_args)
    streams = {"stdout": subprocess.DEVNULL, "stderr": log}  # the server's log: counted at the end
    with servers.running(args.export, *serve_args, code=args.pythonpath, **streams) as (_, port):
        for _ in range(args.connections):
            try:
                s = socket.create_connection(("127.0.0.1", port))
            except OSError as err:
                print(f"connection {len(slow) + 1} failed: {err}")
                break
            s.setblocking(False)
            s.send(b"POST /score HTTP/1.1\r\nHost: x\r\n")
            slow.append(s)
        body = json.dumps({"rows": harness.SAMPLE.read_text().splitlines()[:2]})
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
        for s in slow:
            s.close()
    log.seek(0)
    text = log.read()
    print(f"server log: {len(text.splitlines())} lines, {len(text):,} bytes; first lines:")
    print("\n".join(text.splitlines()[:4]))


if __name__ == "__main__":
    main()
