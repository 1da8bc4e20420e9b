"""What a scoring server takes on at once (``recsys-dist serve``'s limits, docs/serving.md).

Memory: every ``POST /score`` holds, while it is served, an estimate of the memory it takes
(:func:`body_cost` for its body, read and decoded; :func:`rows_cost` for its rows, converted and
scored, and :func:`elements_cost` for the elements of their list values, counted once decoded) against one budget (:class:`InFlight`, ``Limits.memory_bytes``). A request whose
estimate does not fit beside the requests in flight is answered 503 with ``Retry-After``
at once (when its ``Content-Length`` already does not fit, its body is read and dropped, never
held); one that could never fit, even alone, 413. The estimates are calibrated on one shape of request,
with room for the allocator: a 100,000-row Criteo request, 53 MB of JSON objects, estimated
720 MB, took up to ~700 MB each with several at once in the server (``benchmarks/serve_flood.py``,
benchmarks/results/serve_keepalive_cpu2core_20261204.md: 8 at once under a 1000 / 2000 MiB
budget peaked 1014 / 2066 MB above the idle server). The split of that sum between body and rows
(~390 MB in one process: the body, ~200 MB decoded, ~130 MB converting) and ``ELEMENT_BYTES``
were seen once and are not recorded in a results file (docs/serving.md says so).

Connections: ``header_timeout`` for a request's line and headers, ``body_timeout`` for its
body, ``keep_alive`` idle seconds between requests, ``max_connections`` open at once
(``recsys_dist.serve.connections`` applies the first and the last; ``recsys_dist.serve.score_request``
the body's).
"""

from __future__ import annotations

import resource
import threading
from dataclasses import dataclass
from pathlib import Path

MAX_BODY_BYTES = 64 << 20  # per request at most, whatever the memory
BODY_FACTOR = 6  # a body's bytes while read and decoded: itself, ~4x as Python objects (JSON objects), allocator slack
ROW_FEATURE_BYTES = 100  # per row and feature while its rows are converted, scored and answered, allocator slack
# per element of a list value (multi-hot, sequence) while converted: its text, arrow copies, slack. Seen once,
# not in benchmarks/results: 5M elements "7" took ~75 B each past the body's share, 2M distinct 3-letter strings ~140 B
ELEMENT_BYTES = 160
DEFAULT_MEMORY = 2 << 30  # when the memory available cannot be read


def available_memory() -> int | None:
    """Bytes this process could still take: the least of the system's available memory
    (``MemAvailable``) and its cgroup's room (v2 ``memory.max`` - ``memory.current``, or v1);
    None when none of them can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            cap = Path(limit).read_text().strip()
            if cap != "max" and int(cap) < 1 << 60:  # v1 writes a huge number for "no limit"
                found.append(max(int(cap) - int(Path(usage).read_text()), 0))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def open_files_limit() -> int:
    """The process's limit of open files (the soft ``RLIMIT_NOFILE``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(frozen=True)
class Limits:
    """A server's limits (see the module doc). ``memory_bytes``: the memory the requests in
    flight may take together (estimated); ``max_body_bytes``: one request's body at most
    (default: ``MAX_BODY_BYTES``, less when the memory is small); seconds: ``header_timeout``
    (a request's line and headers, from its first byte or from the connection's opening),
    ``body_timeout`` (its whole body), ``keep_alive`` (idle between requests);
    ``max_connections``: open at once, a connection past it is answered 503 and closed;
    ``retry_after``: the seconds a 503 asks a client to wait."""

    memory_bytes: int = DEFAULT_MEMORY
    max_body_bytes: int = 0  # 0: from memory_bytes (see of)
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive: float = 5.0
    max_connections: int = 10_000
    retry_after: int = 1

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            body = max(min(MAX_BODY_BYTES, self.memory_bytes // BODY_FACTOR), 1)
            object.__setattr__(self, "max_body_bytes", body)

    @classmethod
    def of(cls, memory_mb: float | None = None, max_connections: int | None = None, **seconds) -> Limits:
        """Limits for this machine: ``memory_mb`` (None: half of :func:`available_memory`),
        ``max_connections`` (None: 10,000, or the open-files limit less 128 when lower: the
        process must never run out of descriptors, for connections or for loading a model);
        ``seconds``: ``header_timeout``, ``body_timeout``, ``keep_alive``.

        Raises:
            ValueError: a limit that is not positive, naming it.
        """
        for name, value in {"memory_mb": memory_mb, "max_connections": max_connections, **seconds}.items():
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if memory_mb is None:
            free = available_memory()
            memory = max(free // 2, 64 << 20) if free is not None else DEFAULT_MEMORY
        else:
            memory = int(memory_mb * (1 << 20))
        if max_connections is None:
            max_connections = max(min(10_000, open_files_limit() - 128), 1)
        given = {k: v for k, v in seconds.items() if v is not None}
        return cls(memory_bytes=memory, max_connections=max_connections, **given)


def body_cost(size: int) -> int:
    """Estimated bytes a request body of ``size`` bytes takes while read and decoded."""
    return size * BODY_FACTOR


def rows_cost(n_rows: int, n_features: int) -> int:
    """Estimated bytes ``n_rows`` rows of a model of ``n_features`` features take while converted
    and scored."""
    return n_rows * (n_features + 1) * ROW_FEATURE_BYTES


def list_elements(rows: list) -> int:
    """The elements of the list values of request ``rows`` (decoded JSON objects; a text line
    holds none): what :func:`rows_cost` does not see, as a list value is one feature."""
    return sum(len(v) for r in rows if type(r) is dict for v in r.values() if type(v) is list)


def elements_cost(n_elements: int) -> int:
    """Estimated bytes ``n_elements`` list elements take while converted and scored."""
    return n_elements * ELEMENT_BYTES


class Refused(Exception):
    """A request refused by a limit: HTTP ``status`` with ``message``; ``retry_after`` seconds
    (a 503); ``close``: the connection is closed after the answer (its body not all read)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after, self.close = status, message, retry_after, close

    def headers(self) -> dict[str, str]:
        out = {}
        if self.retry_after is not None:
            out["Retry-After"] = str(self.retry_after)
        if self.close:
            out["Connection"] = "close"
        return out


class InFlight:
    """The estimated bytes of the requests in flight, at most ``capacity``. Thread-safe: a
    request's rows are counted from the thread that decodes them. ``hold()``: one request's
    share, grown by ``Hold.add`` and given back by ``Hold.release``."""

    def __init__(self, capacity: int, retry_after: int = 1) -> None:
        self.capacity, self.retry_after = capacity, retry_after
        self.used = 0
        self._lock = threading.Lock()

    def hold(self) -> Hold:
        return Hold(self)


class Hold:
    """One request's share of an :class:`InFlight` budget."""

    def __init__(self, gate: InFlight) -> None:
        self.gate, self.bytes = gate, 0

    def add(self, n: int, what: str) -> None:
        """Hold ``n`` more bytes for ``what`` (e.g. "a 40 MB body").

        Raises:
            Refused: 413 when this request alone would pass the budget, else 503 with
                ``Retry-After`` when it does not fit beside the requests in flight.
        """
        g = self.gate
        with g._lock:
            if self.bytes + n > g.capacity:
                raise Refused(
                    413,
                    f"this request ({what}) would take about {_mb(self.bytes + n)} of memory, more than this server "
                    f"gives all requests in flight ({_mb(g.capacity)}, serve --memory-mb); send fewer rows per request",
                )
            if g.used + n > g.capacity:
                raise Refused(
                    503,
                    f"the server is at capacity: the requests in flight hold {_mb(g.used)} of its {_mb(g.capacity)} "
                    f"(serve --memory-mb), and this one ({what}) needs about {_mb(self.bytes + n)}; retry after "
                    f"{g.retry_after} s, or send fewer rows per request",
                    retry_after=g.retry_after,
                )
            g.used += n
            self.bytes += n

    def release(self) -> None:
        with self.gate._lock:
            self.gate.used -= self.bytes
            self.bytes = 0


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
