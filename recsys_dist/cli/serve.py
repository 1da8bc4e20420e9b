"""``recsys-dist serve DIR --port P``: score JSON rows over HTTP with an export or a publish
directory's model, reloading it when it changes (``recsys_dist.serve.http``, docs/serving.md)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal

import uvicorn

from recsys_dist.logs import quiet_third_party
from recsys_dist.serve.http import ModelHolder, create_app, open_source


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM, then finish the requests in flight; exit code 0.

    Raises:
        ConfigError: DIR is neither an export nor a publish directory.
        CheckpointError / DataError: its model cannot be loaded.
    """
    quiet_third_party()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    holder = ModelHolder(open_source(args.source), reload_seconds=args.reload_seconds)
    served = holder.current
    print(
        f"recsys-dist: serving version {served.version} of {served.loaded.source} on "
        f"http://{args.host}:{args.port} (POST /score, GET /health; reload every {args.reload_seconds:g} s)",
        flush=True,
    )
    config = uvicorn.Config(create_app(holder), host=args.host, port=args.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    def stop(signum, frame) -> None:  # finish the requests in flight, then leave with 0
        server.should_exit = True

    # Our handlers, not uvicorn's: uvicorn re-raises the signal after its shutdown (exit -15).
    server.capture_signals = contextlib.nullcontext
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.run()
    return 0
