"""``recsys-dist serve`` under load and bad input: Nagle off on keep-alive connections, slow
clients timed out while others are served, a memory budget (503 + Retry-After past it),
bodies that are no rows (deep nesting, huge numbers) as 400s, a client that goes away logged as
one line, and repeated log lines rate-limited."""

import http.client
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from starlette.testclient import TestClient

from recsys_dist.cli.serve import listening_socket, server
from recsys_dist.errors import BadRequest
from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.limits import Limits, body_cost
from recsys_dist.serve.request_rows import MAX_LINE_CHARS, MAX_VALUE_CHARS, score_rows
from tests.e2e.serve.conftest import HTTP_LINES as LINES
from tests.unit.serve.test_limits import Records


@pytest.fixture(scope="module")
def holder(export_dir):
    return ModelHolder(open_source(export_dir), 0)


@contextmanager
def running(holder, **limits):
    """The real server (uvicorn, the CLI's protocol and limits) on a free port, in a thread:
    (server, port, records of its loggers)."""
    sock = listening_socket("127.0.0.1", 0)
    srv = server(holder, Limits(**limits))
    records = Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "recsys_dist.serve")]
    for lg in loggers:
        lg.addHandler(records)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < end and thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        yield srv, sock.getsockname()[1], records
    finally:
        srv.should_exit = True
        thread.join(timeout=15)
        sock.close()
        for lg in loggers:
            lg.removeHandler(records)


def _post(conn: http.client.HTTPConnection, rows) -> tuple[int, dict]:
    conn.request("POST", "/score", body=json.dumps({"rows": rows}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_keep_alive_answers_without_nagle_delay(holder):
    with running(holder) as (srv, port, _):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        assert _post(conn, LINES[:1])[0] == 200
        (proto,) = srv.server_state.connections  # the one keep-alive connection, as accepted
        assert proto.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        # The latency itself is a benchmark's (benchmarks/serve_load.py --compare-nagle), not a
        # timed test's: here, that the requests share the one connection the option is on.
        for _ in range(5):
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["version"] == 1
        assert len(srv.server_state.connections) == 1  # all on the same connection
        conn.close()


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes | None = None) -> tuple[float, bytes]:
    """(seconds until the server closed ``sock``, what it answered before), ``trickle`` sent
    every 0.1 s meanwhile; fails past ``seconds``."""
    t0 = time.monotonic()
    sock.settimeout(0.1)
    got = b""
    while time.monotonic() - t0 < seconds:
        try:
            if trickle:
                sock.sendall(trickle)
            data = sock.recv(65536)
            if not data:
                return time.monotonic() - t0, got
            got += data
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - t0, got
    raise AssertionError(f"still open after {seconds} s (answer so far: {got[:200]!r})")


def test_slow_clients_are_closed_while_others_are_served(holder):
    with running(holder, header_timeout=0.5, body_timeout=0.5, keep_alive=0.5) as (srv, port, records):
        results = {}

        def slow(name, first, trickle):
            s = socket.create_connection(("127.0.0.1", port))
            try:
                if first:
                    s.sendall(first)
                results[name] = _closed_within(s, 5.0, trickle)
            except AssertionError as err:
                results[name] = (None, str(err).encode())
            s.close()

        head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        clients = {
            "idle": (None, None),  # connects, sends nothing
            "headers": (head, b"X-Slow: 1\r\n"),  # a header line every 0.1 s, for ever (slowloris)
            "body": (head + b"Content-Length: 100000\r\n\r\n" + b'{"rows": [', b"1,"),  # a slow body
        }
        threads = [threading.Thread(target=slow, args=(n, *a)) for n, a in clients.items()]
        for t in threads:
            t.start()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        served = 0
        while any(t.is_alive() for t in threads):  # others are served all along
            status, out = _post(conn, LINES[:4])
            assert status == 200 and len(out["scores"]) == 4
            served += 1
        for t in threads:
            t.join()
        assert served >= 1
        for name, (seconds, answer) in results.items():
            assert seconds is not None and 0.4 <= seconds < 3.0, (name, seconds, answer[:200])
        assert results["idle"][1] == results["headers"][1] == b""  # no request: closed without an answer
        status_line, _, rest = results["body"][1].partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout", results["body"][1][:300]
        assert b"the body did not arrive within 0.5 s" in rest and b"connection: close" in rest.lower()
        # an idle keep-alive connection is closed after --keep-alive seconds
        assert _closed_within(conn.sock, 3.0)[0] >= 0.3
        closed = [line for line in records.lines() if "no complete request line and headers within 0.5 s" in line]
        assert len(closed) == 2, records.lines()
        assert not [r for r in records.records if r.exc_info], records.lines()


def test_connections_past_the_limit_get_503(holder):
    with running(holder, max_connections=2) as (srv, port, records):
        a = socket.create_connection(("127.0.0.1", port))
        b = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.2)  # both accepted
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        status, out = _post(c, LINES[:2])  # its request is read and dropped: it reads the 503, no reset
        assert status == 503 and "serve --max-connections" in out["error"], out
        assert c.sock is None or c.sock.recv(10) == b""  # closed after the answer
        c.close()
        raw = socket.create_connection(("127.0.0.1", port))  # a client that sends nothing
        seconds, answer = _closed_within(raw, 5.0)
        assert seconds < 3.0 and answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
        assert b"retry-after: 1\r\n" in answer
        a.close()
        b.close()
        end = time.monotonic() + 5
        while len(srv.server_state.connections) > 0 and time.monotonic() < end:
            time.sleep(0.01)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        assert _post(conn, LINES[:2])[0] == 200
        conn.close()
        assert any("refused a connection" in line and "2 connections are open" in line for line in records.lines())


def test_a_client_that_goes_away_is_one_line(holder):
    with running(holder) as (srv, port, records):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b'{"rows": [')
        time.sleep(0.2)
        s.close()
        end = time.monotonic() + 10
        while not records.records and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        assert _post(conn, LINES[:1])[0] == 200  # still serving
        conn.close()
    assert len(records.records) == 1, records.lines()
    (r,) = records.records
    assert r.exc_info is None and "\n" not in r.getMessage()
    assert "went away while sending its body (10 of 1000 bytes came)" in r.getMessage()


def test_memory_budget_503_with_retry_after(holder):
    app = create_app(holder, Limits(memory_bytes=1 << 20))
    gate = app.state.in_flight
    body = json.dumps({"rows": LINES[:3]}).encode()
    with TestClient(app) as c:
        other = gate.hold()  # a request in flight holding nearly all of the budget
        other.add((1 << 20) - body_cost(len(body)) + 1, "another request")
        r = c.post("/score", content=body)  # its Content-Length does not fit: refused, its body read and dropped
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "connection" not in r.headers  # all of it read: the connection serves on
        assert "the server is at capacity" in r.json()["error"] and "retry after 1 s" in r.json()["error"]
        other.release()
        other.add((1 << 20) - body_cost(len(body)) - 100, "another request")  # the body fits, its rows do not
        r = c.post("/score", content=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "3 rows" in r.json()["error"], r.text
        other.release()
        r = c.post("/score", content=body)
        assert r.status_code == 200 and len(r.json()["scores"]) == 3
        assert gate.used == 0  # every request gave its share back
        # One request larger than the whole budget: 413, never fits.
    app = create_app(holder, Limits(memory_bytes=100_000, max_body_bytes=50_000))
    with TestClient(app) as c:
        r = c.post("/score", json={"rows": LINES[:50]})
        assert r.status_code == 413 and "more than this server gives all requests in flight" in r.json()["error"]
        assert "send fewer rows per request" in r.json()["error"] and "retry-after" not in r.headers
        assert app.state.in_flight.used == 0


def test_bodies_that_are_no_rows_are_400s(holder):
    cases = [
        (b"[" * 100_000, "the body nests lists or objects more than"),
        (b'{"rows": [' + b"[" * 50_000 + b"]" * 50_000 + b"]}", "the body nests lists or objects more than"),
        (b'{"rows": [{"I1": ' + b"9" * 5000 + b"}]}", "a number in the body has more than 4300 digits"),
        (b"\xff\xfe{}", "the body is not JSON"),
    ]
    with TestClient(create_app(holder)) as c:
        for body, message in cases:
            r = c.post("/score", content=body)
            assert r.status_code == 400, (body[:40], r.text[:300])
            assert message in r.json()["error"], r.json()
        assert c.post("/score", json={"rows": LINES[:1]}).status_code == 200


def test_list_elements_count_against_the_memory_budget(holder):
    """A list value's elements (multi-hot ids) are counted once the body is decoded: 500,000 in one
    row took no budget before (one row, one feature) and were converted (RSS 2x the budget)."""
    app = create_app(holder, Limits(memory_bytes=64 << 20))
    body = b'{"rows": [{"C1": [' + b",".join([b"7"] * 500_000) + b"]}]}"  # 1 MB: its body fits
    with TestClient(app) as c:
        r = c.post("/score", content=body)
        assert r.status_code == 413, r.text
        assert "1 rows holding 500,000 list elements" in r.json()["error"], r.json()
        assert "more than this server gives all requests in flight (64.0 MiB" in r.json()["error"]
        gate = app.state.in_flight
        other = gate.hold()  # fits alone, not beside a request in flight
        other.add(62 << 20, "another request")
        small = {"rows": [{"C1": [7] * 20_000}]}
        r = c.post("/score", json=small)
        assert r.status_code == 503 and "20,000 list elements" in r.json()["error"], r.text
        other.release()
        assert gate.used == 0


def test_long_values_are_400s_naming_the_limit(holder):
    """A value over MAX_VALUE_CHARS, a text line over MAX_LINE_CHARS: a 400 naming the row, the
    column and the limit (before: "expected 40 fields, got 39" at 100 KB, pyarrow's "straddling
    object" at 5 MB); under them the file route reads a long line whole (its layout sniff read
    64 KiB of the first line: a longer one looked like 39 fields less some)."""
    row = dict(zip([f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)], LINES[0].split("\t")[1:]))
    with TestClient(create_app(holder)) as c:
        for n in (MAX_VALUE_CHARS + 1, 100_000, 5_000_000):
            r = c.post("/score", json={"rows": [row, {**row, "C1": "z" * n}]})
            assert r.status_code == 400, r.text[:300]
            assert r.json()["error"] == (
                f"rows[1], column C1: a value of {n:,} characters, over the limit of {MAX_VALUE_CHARS:,} per value"
            )
        line = LINES[0].rsplit("\t", 1)[0] + "\t" + "a" * (MAX_LINE_CHARS + 1)
        r = c.post("/score", json={"rows": [LINES[1], line]})
        assert r.status_code == 400 and r.json()["error"].startswith(
            f"rows[1]: a text line of {len(line):,} characters, over the limit of {MAX_LINE_CHARS:,} per row"
        ), r.text[:300]
        assert c.post("/score", json={"rows": [row]}).status_code == 200
    # under the limits, a first line of 39 x 4,000 characters is read whole by the file route
    long = {k: "z" * 4000 for k in row}
    with pytest.raises(BadRequest, match=r"rows\[0\], column I1: '(z{4000})' is not"):
        score_rows(holder.current.loaded, [long, row])


def test_a_content_length_over_the_limit_is_answered_at_once(holder):
    """A Content-Length over the body cap: 413 at once, not after --body-timeout when the client
    sends no body; with ``Expect: 100-continue`` no ``100 Continue`` first, and the connection
    closed (before: 100 Continue, then the 413 after 10 s here, 30 s by default)."""
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n"
    with running(holder, body_timeout=10.0) as (srv, port, _):
        for expect in (b"Expect: 100-continue\r\n", b""):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(head + expect + b"\r\n")
            seconds, answer = _closed_within(s, 5.0)
            s.close()
            assert seconds < 3.0, (seconds, answer[:200])
            assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
            assert b"connection: close" in answer.lower() and b"over this server's limit" in answer
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        assert _post(conn, LINES[:1])[0] == 200
        conn.close()
