"""``recsys-dist serve DIR --port P``: score JSON rows over HTTP with an export or a publish
directory's model, reloading it when it changes (``recsys_dist.serve.http``, docs/serving.md).
With ``--wait``, DIR may hold no model yet (a training run that has not published): the server
answers 503 until one appears."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import signal
import socket

import uvicorn

from recsys_dist.errors import ConfigError
from recsys_dist.logs import quiet_third_party
from recsys_dist.serve.connections import guarded_protocol, limit_repeats
from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.limits import Limits


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: one the system picks), not yet listening
    (uvicorn listens on it). Bound here, before the model loads, so that a taken port is told
    at once, as one line.

    Raises:
        ConfigError: the port is out of range or taken, or the address cannot be bound here.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: not a TCP port; give one in 1..65535")
    # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP,
    # and accepted sockets inherit it; with proto 0 each keep-alive answer waited ~40 ms.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # As uvicorn binds: a port left in TIME_WAIT by a stopped server is free again.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use; give another --port, or stop what holds it "
                f"(ss -ltnp 'sport = :{port}' names it)"
            ) from None
        raise ConfigError(
            f"cannot listen on {host}:{port} ({err.strerror or err}); give another --host or --port"
        ) from None
    return sock


def startup_line(holder: ModelHolder, url: str, reload_seconds: float) -> str:
    """The one line printed once the server listens, e.g. ``recsys-dist: serving publish DIR
    version 6 (in-memory scoring) on http://127.0.0.1:8000 (POST /score, GET /health; reload
    every 2 s)``, or, while ``--wait`` has no model yet, ``recsys-dist: listening on URL with no
    model yet, waiting for DIR ...``."""
    endpoints = f"POST /score, GET /health; reload every {reload_seconds:g} s" if reload_seconds > 0 else "no reload"
    if holder.current is None:
        return f"recsys-dist: listening on {url} with {holder.describe()}; 503 until it appears ({endpoints})"
    return f"recsys-dist: serving {holder.describe()} on {url} ({endpoints})"


def limits_of(args: argparse.Namespace) -> Limits:
    """The server's limits from ``serve``'s options (``recsys_dist.serve.limits.Limits.of``).

    Raises:
        ConfigError: a limit that is not positive, naming the option.
    """
    try:
        return Limits.of(
            memory_mb=args.memory_mb,
            max_connections=args.max_connections,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            keep_alive=args.keep_alive,
        )
    except ValueError as err:
        name, _, problem = str(err).partition(" ")  # "memory_mb must be > 0, got 0"
        raise ConfigError(f"serve --{name.replace('_', '-')}: {problem}; give a positive number") from None


class _Server(uvicorn.Server):
    """A uvicorn server that calls ``on_started`` once it listens (not before: a line saying
    it serves must be true when it is read)."""

    def __init__(self, config: uvicorn.Config, on_started) -> None:
        super().__init__(config)
        self.on_started = on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.on_started()


def server(holder: ModelHolder, limits: Limits, on_started=lambda: None) -> _Server:
    """The uvicorn server of ``holder``'s application (h11, ``limits`` applied by
    ``recsys_dist.serve.connections``), its run started by ``run(sockets=[sock])``."""
    config = uvicorn.Config(
        create_app(holder, limits),
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive,
        log_config=None,  # its records go where ours go (the root handler), as plain lines
        log_level="warning",
        access_log=False,
    )
    srv = _Server(config, on_started)
    srv.capture_signals = contextlib.nullcontext  # the caller's handlers (cmd_serve: exit code 0)
    return srv


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM, then finish the requests in flight; exit code 0.

    Raises:
        ConfigError: DIR is neither an export nor a publish directory (without ``--wait``),
            ``--wait`` without reloading or with ``--version``, ``--version`` of an export, or the
            port cannot be bound (taken: the message names it).
        CheckpointError / DataError: its model cannot be loaded.
    """
    quiet_third_party()
    # force: an import (fbgemm_gpu) has already logged through the root logger, which set it up
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    limit_repeats()  # a flood of one error (a bad client, a slowloris) logs a few lines a minute
    if args.wait and args.reload_seconds <= 0:
        raise ConfigError("--wait needs --reload-seconds > 0: the model is picked up by the reload thread")
    limits = limits_of(args)
    source = open_source(args.source, wait=args.wait, version=args.version)
    sock = listening_socket(args.host, args.port)
    with sock:
        holder = ModelHolder(source, reload_seconds=args.reload_seconds)
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        srv = server(holder, limits, lambda: print(startup_line(holder, url, args.reload_seconds), flush=True))

        def stop(signum, frame) -> None:  # finish the requests in flight, then leave with 0
            srv.should_exit = True

        # Our handlers, not uvicorn's: uvicorn re-raises the signal after its shutdown (exit -15).
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        srv.run(sockets=[sock])
    return 0
