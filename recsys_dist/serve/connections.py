"""The server's connections (uvicorn's h11 protocol, guarded) and its log under load.

:func:`guarded_protocol` gives the protocol class ``recsys-dist serve`` runs uvicorn with. Over
uvicorn's own it:

- sets ``TCP_NODELAY`` on every accepted connection: uvicorn writes a response's head and body
  as two segments, and with Nagle's algorithm on, the second waits for the client's delayed ACK
  (~40 ms on Linux) on a keep-alive connection;
- closes a connection whose request line and headers are not all in within
  ``Limits.header_timeout`` seconds, counted from the connection's opening or from the first
  byte of its next request, however slowly they trickle in (uvicorn has no such timeout: a
  client sending a header byte now and then held its connection for ever);
- answers a connection past ``Limits.max_connections`` open ones 503 with ``Retry-After`` and
  closes it (after a second of reading and dropping its request, so that the client reads the
  503 rather than a reset, while the refused ones are few).

:class:`RepeatFilter` keeps the log readable under a flood: at most ``burst`` lines of one kind
(logger and message) per ``window`` seconds, then one line saying how many were left out.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from recsys_dist.serve.limits import Limits, open_files_limit

log = logging.getLogger("recsys_dist.serve")


def no_delay(transport) -> None:
    """Turn Nagle's algorithm off on a transport's TCP socket (nothing for another socket)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer may already be gone
            pass


def _busy(limits: Limits) -> bytes:
    body = json.dumps(
        {
            "error": f"the server holds its most connections ({limits.max_connections}, serve --max-connections); "
            f"retry after {limits.retry_after} s"
        }
    ).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"retry-after: {limits.retry_after}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guards of the module doc; ``limits``: a class attribute
    (:func:`guarded_protocol` sets it)."""

    limits: Limits = Limits()
    most_open = 2000  # connections open at most, refused ones lingering included (guarded_protocol)
    _head_timer = None
    _refused = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        no_delay(transport)
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning(
                "recsys-dist serve: refused a connection from %s: %d connections are open, the most allowed "
                "(serve --max-connections)",
                _peer(self.client),
                self.limits.max_connections,
            )
            self._refused = True
            transport.write(_busy(self.limits))
            if len(self.connections) < self.most_open and transport.can_write_eof():
                # Half-close and read on for a moment: closed at once, the client's request would meet
                # a reset (EPIPE) instead of the 503 it can read.
                transport.write_eof()
                self.loop.call_later(min(1.0, self.limits.header_timeout), transport.close)
            else:
                transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # a refused connection's request: dropped
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first byte of a request: its head has header_timeout from now
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's head is complete
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        log.warning(
            "recsys-dist serve: closed the connection from %s: no complete request line and headers within %g s "
            "(serve --header-timeout)",
            _peer(self.client),
            self.limits.header_timeout,
        )
        self.transport.close()


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"


def guarded_protocol(limits: Limits) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` class applying ``limits`` (uvicorn's ``http=`` option)."""
    most_open = max(min(2 * limits.max_connections, open_files_limit() - 32), limits.max_connections + 1)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "most_open": most_open})


class RepeatFilter(logging.Filter):
    """Lets at most ``burst`` records of one kind (logger, level, message template) through per
    ``window`` seconds; the first one let through after some were held back says how many."""

    MAX_KINDS = 1000  # kinds remembered at most (a message formatted without arguments is a kind each)

    def __init__(self, burst: int = 5, window: float = 60.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self._seen: dict[tuple, list] = {}  # kind -> [window start, let through, held back]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg)[:300])
        now = self.clock()
        with self._lock:
            state = self._seen.get(kind)
            if state is None:
                if len(self._seen) >= self.MAX_KINDS:
                    self._seen.clear()
                state = self._seen[kind] = [now, 0, 0]
            held = 0
            if now - state[0] >= self.window:
                held, state[:] = state[2], [now, 0, 0]
            if state[1] >= self.burst:
                state[2] += 1
                return False
            state[1] += 1
        if held:
            record.msg = f"{record.msg} ({held} more like it were not logged in the last {self.window:g} s)"
        return True


def limit_repeats(names=("uvicorn.error", "recsys_dist.serve", "asyncio"), **kw) -> RepeatFilter:
    """Put one :class:`RepeatFilter` on the loggers ``names`` (where the server's records start)
    in place of one put there before; returns it."""
    f = RepeatFilter(**kw)
    for name in names:
        logger = logging.getLogger(name)
        for old in [x for x in logger.filters if isinstance(x, RepeatFilter)]:
            logger.removeFilter(old)
        logger.addFilter(f)
    return f
