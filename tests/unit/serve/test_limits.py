"""``recsys-dist serve`` under load and bad input: Nagle off on keep-alive connections, slow
clients timed out while others are served, a memory budget (503 + Retry-After past it),
bodies that are no rows (deep nesting, huge numbers) as 400s, a client that goes away logged as
one line, and repeated log lines rate-limited."""

import argparse
import logging
import socket

import pytest

from recsys_dist.cli.serve import limits_of, listening_socket
from recsys_dist.errors import ConfigError
from recsys_dist.serve.connections import RepeatFilter


class Records(logging.Handler):
    """The records of the server's loggers (uvicorn's included), as they are emitted."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


def test_listening_socket_is_tcp():
    """asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP (accepted ones inherit it)."""
    with listening_socket("127.0.0.1", 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP


def test_repeated_log_lines_are_rate_limited():
    now = [0.0]
    f = RepeatFilter(burst=3, window=60.0, clock=lambda: now[0])
    logger = logging.getLogger("recsys_dist.serve.test_repeats")
    logger.propagate = False
    records = Records()
    logger.addHandler(records)
    logger.addFilter(f)
    try:
        for i in range(1000):
            logger.warning("client %s went away", i)
        logger.warning("another kind of line")
        now[0] = 61.0
        logger.warning("client %s went away", "late")
    finally:
        logger.removeHandler(records)
        logger.removeFilter(f)
    assert records.lines() == [
        "client 0 went away",
        "client 1 went away",
        "client 2 went away",
        "another kind of line",
        "client late went away (997 more like it were not logged in the last 60 s)",
    ]


def test_limit_options():
    given = dict(memory_mb=100.0, max_connections=None, header_timeout=2.0, body_timeout=3.0, keep_alive=4.0)
    limits = limits_of(argparse.Namespace(**given))
    assert limits.memory_bytes == 100 << 20 and limits.max_body_bytes == (100 << 20) // 6  # a body: its share
    assert (limits.header_timeout, limits.body_timeout, limits.keep_alive) == (2.0, 3.0, 4.0)
    assert 0 < limits.max_connections <= 10_000
    assert limits_of(argparse.Namespace(**{**given, "memory_mb": 1e6})).max_body_bytes == 64 << 20
    for key, value in [("memory_mb", 0), ("max_connections", -1), ("header_timeout", 0.0)]:
        option = key.replace("_", "-")
        with pytest.raises(ConfigError, match=f"serve --{option}: must be > 0, got {value}; give a positive number"):
            limits_of(argparse.Namespace(**{**given, key: value}))


def test_decode_body_refuses_a_lone_surrogate_and_takes_a_pair_and_other_escapes():
    """Only a surrogate escape makes decode_body re-encode the body: a lone one is refused, a
    pair (one character) and other escapes decode as JSON says."""
    from recsys_dist.errors import BadRequest
    from recsys_dist.serve.score_request import decode_body

    for raw in (b'{"rows": [{"C3": "\\ud800"}]}', b'{"rows": ["x\\uDBFF"]}'):
        with pytest.raises(BadRequest, match="lone surrogate"):
            decode_body(raw)
    assert decode_body(b'{"a": "\\ud83d\\ude00 \\u00e9"}') == {"a": "\U0001f600 \u00e9"}
    assert decode_body(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash: text, no surrogate
