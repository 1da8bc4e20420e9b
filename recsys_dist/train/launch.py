"""Starting ranks: :func:`launch` runs a Python function on N local ranks (the library's
way), :func:`launch_workers` runs ``recsys-dist train``'s rank function on them (the command line's way).
Both start them through :func:`start_ranks`, the one place that drives torch.distributed's elastic
launcher (the code ``torchrun`` runs): its config, the launcher's pid and ``$RECSYS_DIST_*``
variables handed to the ranks, the forkserver.

``recsys_dist.launch`` is this module's :func:`launch`.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

from recsys_dist.distributed.env import LAUNCHER_PID_ENV, die_with_launcher
from recsys_dist.errors import RankFailedError  # noqa: F401 (raised here; defined in errors)
from recsys_dist.train.rank_failure import first_killed

T = TypeVar("T")
Args = TypeVarTuple("Args")


def launch(fn: Callable[[*Args], T], nproc: int, *args: *Args, max_restarts: int = 0) -> list[T]:
    """Run ``fn(*args)`` on ``nproc`` local ranks and return each rank's return value.

    The ranks are new processes started by torch.distributed's elastic launcher
    (``elastic_launch``, standalone rendezvous on a free port, ``spawn`` start method), with
    the environment of a torchrun worker (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ...), so a :class:`recsys_dist.Trainer` built inside ``fn`` joins them
    into one process group::

        # my_job.py
        import recsys_dist
        from recsys_dist.config import load_config

        def job(config_path, run_dir):
            with recsys_dist.Trainer(load_config(config_path), run_dir) as trainer:
                return trainer.fit()

        if __name__ == "__main__":
            summaries = recsys_dist.launch(job, 2, "configs/criteo_quickstart.yaml", "runs/mine")

    ``fn`` must be importable by name in a new process, as with multiprocessing's spawn: a
    function defined at the top level of a module (or of the script, whose launching code
    sits under ``if __name__ == "__main__":``), not a lambda, a nested function or a
    function typed into a notebook or the interactive interpreter (put it in a ``.py``
    file and import it). ``args`` and the return values must pickle.

    The ranks end with this process, however it ends (SIGKILL included: Linux's
    ``PR_SET_PDEATHSIG`` and a parent watch, ``recsys_dist.distributed.env.die_with_launcher``).

    Args:
        fn: the function every rank runs.
        nproc: the number of ranks (>= 1).
        *args: passed to ``fn`` on every rank.
        max_restarts: restarts of the whole group after a rank fails.

    Returns:
        ``[rank 0's return value, rank 1's, ...]``: for type checkers a ``list[T]`` for an ``fn``
        that returns ``T`` (a ``Trainer.fit()`` summary: ``list[recsys_dist.FitSummary]``), and
        ``args`` are checked against ``fn``'s parameters.

    Raises:
        RankFailedError: a rank raised or died; names the rank, its error and traceback.
        TypeError: ``fn`` or ``args`` cannot be sent to a new process.
        ValueError: ``nproc`` < 1.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an integer >= 1, got {nproc!r}")
    _check_spawnable(fn, args)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # The agent logs each failure with its traceback, which RankFailedError carries anyway.
    agent_log = logging.getLogger("torch.distributed.elastic")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    try:
        results = start_ranks(rank_main, (fn, *args), nproc, max_restarts, "spawn")
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        raise RankFailedError(rank, failure_message(failure), _failure_traceback(failure)) from None
    finally:
        agent_log.setLevel(level)
    return [results[r] for r in range(nproc)]


def _standalone(nproc: int, max_restarts: int, start_method: str):
    """The elastic agent's config for ``nproc`` ranks on this machine alone (torchrun
    ``--standalone``: a c10d rendezvous store on a free local port)."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        start_method=start_method,
    )


def rank_main(fn: Callable[..., Any], *args: Any) -> Any:
    """What every rank of :func:`launch` runs: ``fn(*args)``, in a process that ends when the
    launcher's does (``recsys_dist.distributed.env.die_with_launcher``)."""

    die_with_launcher()
    return fn(*args)


def _check_spawnable(fn: Callable, args: tuple) -> None:
    """Refuse, in this process, what a spawned rank could not unpickle."""
    main = sys.modules.get("__main__")
    name = getattr(fn, "__qualname__", repr(fn))
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"launch: {name} is defined in an interactive session (a notebook or the REPL), which a new "
            "process cannot import; define it in a .py file and import it from there"
        )
    try:
        pickle.dumps(fn)
    except Exception as err:  # noqa: BLE001 - any pickling failure means the same thing
        raise TypeError(
            f"launch: {name} cannot be sent to a new process ({err}); give a function defined at the top "
            "level of a module, not a lambda or a nested function"
        ) from None
    try:
        pickle.dumps(args)
    except Exception as err:  # noqa: BLE001
        raise TypeError(f"launch: the arguments for {name} cannot be pickled ({err})") from None


def failure_message(failure) -> str:
    """The error text of an elastic ``ProcessFailure``: ``"ExceptionType: text"`` when the
    rank recorded its exception, else what the launcher knows (e.g. the signal)."""
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", msg)
        if isinstance(msg, dict):
            msg = msg.get("message", str(msg))
    return str(msg)


def _failure_traceback(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        return str(msg.get("extraInfo", {}).get("py_callstack", ""))
    return ""


RANK_PRELOAD = [
    "recsys_dist.train.forkserver_init",  # first: SIGUSR1 dumps stacks in a rank from its start
    "torch",
    "torchrec",
    "torchrec.distributed",
    "recsys_dist.train.worker",
]


def start_forkserver() -> None:
    """Start (once per process) the clean process that ``start_method: forkserver`` forks the
    ranks from, importing :data:`RANK_PRELOAD` there; called early, its imports overlap the
    launcher's own work (config checks, data preparation). Unlike a fork of the launcher, whose
    threads (the rendezvous store's, the data library's) may hold a lock at the instant of the
    fork, the server is single-threaded."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    forkserver.ensure_running()


def launch_workers(
    entry: Callable[..., int],
    args: tuple,
    nproc_per_node: int,
    max_restarts: int,
    start_method: str = "spawn",
) -> None:
    """Run ``entry(*args)`` (``recsys-dist train``'s rank, ``recsys_dist.train.worker.rank_main``
    on the resolved Job) on ``nproc_per_node`` local ranks through torch.distributed's
    elastic launcher (``elastic_launch``, torchrun's agent, standalone c10d rendezvous).

    ``start_method``: ``"forkserver"`` (the ranks fork from one clean process that imported torch
    and torchrec once, :func:`start_forkserver`; ``args`` pickled), ``"spawn"`` (fresh
    interpreters, those imports in each rank, about 3 CPU-seconds each; CUDA) or ``"fork"`` (the
    ranks inherit this process as it is: no imports, but this process runs threads, the agent's
    rendezvous store among them, and a fork while one holds a lock can leave a rank stuck at its
    start; ``recsys-dist train`` keeps this process at one intra-op thread so that no OpenMP pool
    is copied). Each rank restores the default signal handlers before it starts.

    Raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` when a rank
    fails (after ``max_restarts`` restarts of the whole group); it names the first failing
    rank and carries its error.
    """
    # The launcher's own INFO lines would drown the summary.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # It logs a failed rank with the launcher's traceback; the caller reports the rank's error.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # "Terminating process N via signal SIGTERM": the other ranks being stopped after a failure,
    # which the caller's message says.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    start_ranks(entry, args, nproc_per_node, max_restarts, start_method)


OUR_ENV = "RECSYS_DIST_"


def start_ranks(entry: Callable[..., T], args: tuple, nproc: int, max_restarts: int, start_method: str) -> dict[int, T]:
    """Run ``entry(*args)`` on ``nproc`` local ranks through torch.distributed's elastic launcher
    (``elastic_launch``: torchrun's agent, standalone c10d rendezvous, :func:`_standalone`) and
    return each local rank's return value; the one place ranks are started, for :func:`launch`
    and :func:`launch_workers`.

    Before the ranks start: ``$RECSYS_DIST_LAUNCHER_PID`` names this process (the ranks die with
    it: ``recsys_dist.distributed.env.die_with_launcher``), a ``forkserver`` start method has its
    server running (:func:`start_forkserver`), and this process's output is flushed (a forked
    rank would write it again). Each rank runs :func:`_with_our_env`: the ``$RECSYS_DIST_*``
    variables as they are here now, then ``entry(*args)``.

    Raises:
        ChildFailedError: a rank failed (after ``max_restarts`` restarts of the whole group).
    """
    from torch.distributed.launcher.api import elastic_launch

    config = _standalone(nproc, max_restarts, start_method)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks die with this process
    if start_method == "forkserver":
        start_forkserver()
    sys.stdout.flush()
    sys.stderr.flush()
    ours = {k: v for k, v in os.environ.items() if k.startswith(OUR_ENV)}
    return elastic_launch(config, _with_our_env)(ours, entry, *args)


def _with_our_env(ours: dict[str, str], entry: Callable[..., T], *args: Any) -> T:
    """``entry(*args)`` in a rank whose ``$RECSYS_DIST_*`` variables are the launcher's at the
    launch (``ours``): a forkserver's ranks otherwise get the server's environment as it was
    when it started, before the launcher set some of them (the run lock, the launcher's pid,
    the run clock, the verified checkpoint). A spawned rank has them already (no change)."""
    for k in [k for k in os.environ if k.startswith(OUR_ENV) and k not in ours]:
        del os.environ[k]
    os.environ.update(ours)
    return entry(*args)


def first_failure(err) -> tuple[int, Any]:
    """The rank that failed first in a ``ChildFailedError`` of :func:`launch_workers`, and its
    ``ProcessFailure``: of every rank that recorded an error (``error.json`` beside the
    reported one), the earliest written. The agent reports the first rank it saw exit,
    which may be a peer that failed only because the first one's connections closed. A rank
    that SIGKILL ended (which records no error) comes before all of them: its peers' errors are
    its effect (``recsys_dist.train.rank_failure.first_killed``)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    killed = first_killed(err.failures)
    if killed is not None:
        return killed
    rank, failure = err.get_first_failure()
    path = Path(failure.error_file) if failure.error_file else None
    if path is None or not path.parent.parent.is_dir():
        return rank, failure
    written = [
        (p.stat().st_mtime_ns, int(p.parent.name), p)
        for p in path.parent.parent.glob("*/error.json")
        if p.parent.name.isdigit()
    ]
    if not written:
        return rank, failure
    _, first, file = min(written)
    if first == failure.local_rank:
        return rank, failure
    return rank - failure.local_rank + first, ProcessFailure(first, -1, 1, str(file))
