"""Multi-process test helper: run a function on N gloo ranks on CPU, collect results.

A rank that raises makes ``run_ranks`` kill the others at once and raise that rank's
traceback, and a deadline bounds the whole run, so a broken collective fails a test
instead of hanging CI.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# What the forkserver of run_ranks (and of the tests' `recsys-dist train` runs) imports once.
FORKSERVER_PRELOAD = [
    "recsys_dist.train.forkserver_init",
    "torch",
    "torchrec",
    "torchrec.distributed",
    "recsys_dist.train.trainer",
    "recsys_dist.cli.main",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue,
    backend: str,
    env: dict | None,
    pg_timeout_s: float | None = None,
) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if env is not None:  # a forkserver's child starts with the server's environment
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = None if pg_timeout_s is None else timedelta(seconds=pg_timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensor data; torch's multiprocessing pickler would pass shared
        # memory handles that die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    backend: str = "gloo",
    start_method: str | None = None,
    pg_timeout_s: float | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks (gloo, or nccl on GPUs).

    ``start_method``: ``"forkserver"`` (default for gloo) forks the ranks from one clean
    server process started on first use, which has imported torch, torchrec and recsys_dist
    once (a new interpreter spends ~6 CPU-seconds on them) and is reused by later calls of
    this process; the ranks get this process's current environment. ``"spawn"`` (default
    for nccl) starts fresh interpreters. Plain ``fork`` is not offered: a copy of an OpenMP
    pool this process used hangs a rank that computes on more than one thread.

    ``pg_timeout_s``: the process group's timeout (None: torch's default, 30 min for gloo).
    A short one makes ranks that wait in different collectives raise there, naming the
    collective in the traceback, instead of waiting for ``timeout_s``.

    ``fn`` must be importable (defined at module level); its return value must pickle.
    Returns the results in rank order. Raises RuntimeError with the first failing rank's
    traceback, or on timeout.
    """
    if start_method is None:
        start_method = "spawn" if backend == "nccl" else "forkserver"
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"run_ranks: start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    env = dict(os.environ) if start_method == "forkserver" else None
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, queue, backend, env, pg_timeout_s), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        import queue as queue_mod

        deadline = time.monotonic() + timeout_s
        dead_since: float | None = None
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue_mod.Empty:
                # A rank that died without reporting (killed, or failed before _worker ran, e.g.
                # a __main__ without its guard under spawn) used to cost the whole timeout.
                # Its last words may still be in the pipe: give them a few seconds.
                dead = [
                    (r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)
                ]
                if dead:
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > 5:
                        raise RuntimeError(
                            f"run_ranks: rank(s) {[r for r, _ in dead]} died without a result "
                            f"(exit codes {[c for _, c in dead]}); see their stderr above"
                        ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"run_ranks: no result within {timeout_s}s (a rank hung or died)") from None
                continue
            if status == "err":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
