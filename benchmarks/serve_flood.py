"""Memory of ``recsys-dist serve`` under large requests at once: N clients each POST one
request of R Criteo rows as JSON objects at the same moment; prints each answer's status,
``Retry-After`` and seconds, and the server's peak RSS above its idle RSS (sampled every 20 ms
from /proc).

Not a test. Usage:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_flood.py EXPORT_DIR [--clients 8] [--rows 100000] \\
        [--serve-args "--memory-mb 1000"] [--pythonpath DIR]

``--pythonpath``: the recsys_dist to run the server from (default this checkout), e.g. an older
commit unpacked with ``git archive COMMIT | tar -x -C DIR``.
"""

from __future__ import annotations

import http.client
import json
import shlex
import subprocess
import threading
import time
from pathlib import Path

import harness
import servers


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main(argv: list[str] | None = None) -> None:
    p = servers.add_server_args(harness.parser(__doc__, "serve_flood", "2 clients of 200 rows"))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.rows = 2, 200
    with harness.Results(args, argv):
        flood(args)


def flood(args) -> None:
    """Start the server, send the requests at once, print the answers and the RSS."""
    lines = harness.SAMPLE.read_text().splitlines()
    body = json.dumps({"rows": servers.criteo_objects([lines[i % len(lines)] for i in range(args.rows)])}).encode()
    serve_args = shlex.split(args.serve_args)
    quiet = {"stdout": subprocess.DEVNULL}
    with servers.running(args.export, *serve_args, code=args.pythonpath, **quiet) as (proc, port):
        idle = peak = _rss_mb(proc.pid)
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _rss_mb(proc.pid))
                time.sleep(0.02)

        answers = []

        def client() -> None:
            t = time.perf_counter()
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            try:
                c.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                text = r.read()
                error = "" if r.status == 200 else json.loads(text).get("error", "")[:90]
                answers.append((r.status, r.getheader("retry-after"), round(time.perf_counter() - t, 1), error))
            except OSError as err:
                answers.append(("no answer", None, round(time.perf_counter() - t, 1), repr(err)[:90]))

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        watcher.join()
        print(
            f"body {len(body) / 1e6:.1f} MB x {args.clients} clients; server RSS idle {idle:.0f} MB, "
            f"peak {peak:.0f} MB (+{peak - idle:.0f} MB); alive after: {proc.poll() is None}"
        )
        for a in sorted(answers, key=str):
            print(a)


if __name__ == "__main__":
    main()
