"""``recsys-dist serve`` for the serving benches (serve_load.py, serve_flood.py,
serve_slowloris.py): a server started on a free port and waited for until ``GET /health``
answers (:func:`running`), the options of a bench that starts one (:func:`parser`), and raw
Criteo rows as the JSON objects a client sends (:func:`criteo_objects`)."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import harness


def add_server_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add to a :func:`harness.parser` the options of a bench that starts a server: ``export``
    (the directory served), ``--serve-args`` (more ``recsys-dist serve`` options) and
    ``--pythonpath`` (the checkout whose recsys_dist serves, :func:`running`'s ``code``)."""
    p.add_argument("export", type=Path)
    p.add_argument("--serve-args", default="", help="more `recsys-dist serve` options, e.g. '--memory-mb 1000'")
    p.add_argument("--pythonpath", type=Path, default=harness.ROOT, help="where the server's recsys_dist comes from")
    return p


def healthy(port: int) -> bool:
    """Whether ``GET /health`` on 127.0.0.1:``port`` answers 200 (within 5 s)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextlib.contextmanager
def running(
    export: Path,
    *serve_args: Any,
    code: Path = harness.ROOT,
    python_code: str | None = None,
    stdout: IO | int | None = None,
    stderr: IO | int | None = None,
    timeout_s: float = 180.0,
) -> Iterator[tuple[subprocess.Popen, int]]:
    """``recsys-dist serve EXPORT --port P --reload-seconds 0 SERVE_ARGS`` with the recsys_dist
    of the checkout ``code`` (its PYTHONPATH and working directory: ``python -m`` puts the
    working directory first on sys.path); ``python_code``: run ``python -c python_code serve ...``
    instead of the CLI module (a patched server). Yields (process, port) once ``/health``
    answers; terminates the server on exit.

    Raises:
        RuntimeError: the server exited, or did not answer within ``timeout_s``.
    """
    port = harness.free_port()
    head = ["-c", python_code] if python_code is not None else ["-m", "recsys_dist.cli.main"]
    cmd = [sys.executable, *head, "serve", str(export), "--port", str(port), "--reload-seconds", "0"]
    cmd += [str(a) for a in serve_args]
    proc = subprocess.Popen(cmd, env=harness.child_env(code), cwd=code, stdout=stdout, stderr=stderr, text=True)
    try:
        end = time.monotonic() + timeout_s
        while not healthy(port):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
            if time.monotonic() > end:
                raise RuntimeError(f"the server did not answer /health within {timeout_s:g} s: {' '.join(cmd)}")
            time.sleep(0.2)
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def criteo_objects(lines: list[str]) -> list[dict]:
    """Raw Criteo lines as JSON objects: integers as numbers, empty fields left out, no label."""
    from recsys_dist.data.formats.criteo import COLUMNS

    out = []
    for line in lines:
        fields = zip(COLUMNS[1:], line.split("\t")[1:])
        out.append({c: int(v) if c[0] == "I" else v for c, v in fields if v != ""})
    return out
