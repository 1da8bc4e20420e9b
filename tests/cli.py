"""``recsys-dist ARGS`` for the tests: in this process where nothing trains, else in a child
that starts as a fresh ``recsys-dist`` process would, without paying for its imports.

A fresh ``python -m recsys_dist.cli.main`` imports torch and TorchRec first: ~6 CPU-seconds before
it does anything. The commands that do not train (evaluate, predict, export, report, compare,
plan, preprocess) therefore run here, through ``recsys_dist.cli.main.main``, with the process state
they see or change (environment, working directory, ``sys.path``, logger levels, signal
handlers, warning filters, torch's thread count) set up as a fresh process would have it and
put back afterwards. ``train`` runs in a child forked from a forkserver (a clean process that
imported torch, TorchRec and recsys_dist once, the server ``recsys_dist.testing.run_ranks``
uses): the child takes the command's environment, working directory and ``sys.path``, writes
stdout and stderr to files, and runs the console entry point's path (``cli.run``: ranks forked
on CPU, exit without interpreter finalisation), so it is the ``recsys-dist`` process minus
its imports; the forkserver its ranks fork from is likewise a fork of that clean child, which
takes the launcher's environment when the command asks for it, not a new interpreter that
imports torch again (``_rank_server_by_fork``). ``inprocess=True`` runs a ``train`` here instead, when the run must stop before
any rank or training step (a config or data error); ``inprocess=False`` keeps any command in
a real subprocess, so that the ``python -m recsys_dist.cli.main`` path of each command stays
covered somewhere.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Commands that never start a rank or train a step.
IN_PROCESS = {"evaluate", "predict", "export", "report", "compare", "plan", "preprocess"}
# Loggers the CLI sets to ERROR (recsys_dist.logs.THIRD_PARTY_LOGGERS, cmd_plan, train.worker.launch_ranks).
QUIETED = (
    "torchrec.distributed.planner",
    "torchrec.distributed.comm",
    "torch.distributed.elastic.agent.server.api",
)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run_cli(
    args,
    tmp=None,
    *,
    cwd=ROOT,
    env: dict | None = None,
    timeout: float = 600,
    inprocess: bool | None = None,
    launcher=(),
    hung=None,
) -> subprocess.CompletedProcess:
    """``recsys-dist ARGS``: its exit code, stdout and stderr (text).

    Args:
        args: the command line after ``recsys-dist`` (items are passed through ``str``).
        tmp: conversions are cached under ``tmp/cache`` (``RECSYS_DIST_CACHE``) when given.
        cwd: the working directory of the command (default the repository root).
        env: environment variables set for the command (a value None unsets one).
        timeout: seconds a subprocess or child may run (``subprocess.TimeoutExpired`` after that).
        inprocess: True runs the command in this process (a ``train`` that must fail before
            any rank starts), False in a subprocess; None (default): in this process for the
            commands of ``IN_PROCESS`` without a launcher, ``train`` in a forkserver's child,
            anything else in a subprocess.
        hung: for a ``train`` that a test makes hang on purpose: called with the command's
            pid every 0.1 s; once it returns True the command is treated as past its timeout
            (its stacks dumped, ``HungCommand``) without waiting out the rest of ``timeout``.
        launcher: the command that runs ``-m recsys_dist.cli.main`` (e.g. torchrun and its
            options); default this Python. Implies a subprocess.
    """
    args = [str(a) for a in args]
    overrides = {"RECSYS_DIST_CACHE": str(Path(tmp) / "cache")} if tmp is not None else {}
    overrides.update({k: (None if v is None else str(v)) for k, v in (env or {}).items()})
    forked = inprocess is None and not launcher and bool(args) and args[0] == "train"
    if inprocess is None:
        inprocess = not launcher and bool(args) and args[0] in IN_PROCESS
    if inprocess and launcher:
        raise ValueError("a launcher starts a subprocess; it cannot run in this process")
    if hung is not None and not forked:
        raise ValueError("hung: only for a train run in a forkserver's child (the default for train)")
    if inprocess:
        return _in_process(args, Path(cwd), overrides)
    full_env = {k: v for k, v in {**os.environ, **overrides}.items() if v is not None}
    if forked:
        return _forked(args, Path(cwd), full_env, timeout, hung)
    cmd = [*(launcher or [sys.executable]), "-m", "recsys_dist.cli.main", *args]
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def _in_process(args: list[str], cwd: Path, overrides: dict) -> subprocess.CompletedProcess:
    from recsys_dist.cli import main as cli

    saved_env, saved_cwd, saved_path = dict(os.environ), os.getcwd(), list(sys.path)
    saved_levels = {
        name: lg.level for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)
    }
    saved_root = logging.getLogger().level
    saved_signals = {sig: signal.getsignal(sig) for sig in SIGNALS}
    threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    out, err = io.StringIO(), io.StringIO()
    try:
        for k, v in overrides.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _import_from(overrides.get("PYTHONPATH"))
        os.chdir(cwd)
        with warnings.catch_warnings(), redirect_stdout(out), redirect_stderr(err):
            _fresh_interpreter_warnings()
            code = _exit_code(cli.main, args)
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger):
                if name in saved_levels:
                    lg.setLevel(saved_levels[name])
                elif name in QUIETED:
                    lg.setLevel(logging.NOTSET)
        logging.getLogger().setLevel(saved_root)
        for sig, handler in saved_signals.items():
            if handler is not None:
                signal.signal(sig, handler)
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)
    return subprocess.CompletedProcess(["recsys-dist", *args], code, out.getvalue(), err.getvalue())


def _forked(args: list[str], cwd: Path, env: dict, timeout: float, hung=None) -> subprocess.CompletedProcess:
    from recsys_dist.testing import FORKSERVER_PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="recsys_dist_cli_") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        # Not a daemon: a daemonic process may not start the ranks.
        child = ctx.Process(target=_child, args=(args, str(cwd), env, str(out), str(err)), daemon=False)
        child.start()
        if hung is None:
            child.join(timeout)
        else:
            deadline = time.monotonic() + timeout
            while child.is_alive() and time.monotonic() < deadline and not hung(child.pid):
                child.join(0.1)
        if child.is_alive():  # its ranks die with it (die_with_launcher)
            stacks = _dump_stacks(child.pid)
            child.kill()
            child.join()
            raise HungCommand(["recsys-dist", *args], timeout, stacks + err.read_text(errors="replace")[-20000:])
        text = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
        return subprocess.CompletedProcess(["recsys-dist", *args], child.exitcode, *text)


class HungCommand(subprocess.TimeoutExpired):
    """A ``recsys-dist`` command still running after its timeout; the message ends with its stderr,
    which holds every process's Python stacks (the launcher's and its ranks', dumped on SIGUSR1)."""

    def __init__(self, cmd: list[str], timeout: float, stderr: str):
        super().__init__(cmd, timeout, stderr=stderr)

    def __str__(self) -> str:
        return f"{super().__str__()}\n--- its stderr (Python stacks on SIGUSR1) ---\n{self.stderr}"


def process_tree(pid: int) -> dict[int, tuple[int, str]]:
    """The live (not zombie) processes below ``pid`` (children, theirs, ...) in breadth-first
    order, each with its parent's pid and its command line."""
    procs: dict[int, tuple[int, str]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[0] not in ("Z", "X"):
            procs[int(proc.name)] = (int(stat[1]), cmd)
    found: dict[int, tuple[int, str]] = {}
    todo = [pid]
    while todo:
        p = todo.pop(0)
        kids = [c for c, (pp, _) in procs.items() if pp == p]
        found.update({c: procs[c] for c in kids})
        todo.extend(kids)
    return found


def _dump_stacks(pid: int) -> str:
    """SIGUSR1 to ``pid`` and its ranks below it, one at a time so that their outputs do not
    interleave (``recsys_dist.logs.dump_stacks_on_sigusr1``: each prints its threads' stacks to
    its stderr); returns the process tree as text. Processes between (a forkserver the ranks
    fork from) and the resource tracker are passed over: they have no such handler, and
    SIGUSR1 would end them."""
    tree = process_tree(pid)
    parents = {pp for pp, _ in tree.values()}
    signalled = [pid] + [p for p, (_, cmd) in tree.items() if p not in parents and "resource_tracker" not in cmd]
    for p in reversed(signalled):  # the ranks, then the launcher
        try:
            os.kill(p, signal.SIGUSR1)
        except ProcessLookupError:
            pass
        time.sleep(0.5)  # faulthandler writes from the signal handler, at once
    return f"processes: {[(p, cmd[:60]) for p, (_, cmd) in tree.items()]}; signalled {signalled}\n"


def _child(args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """The forkserver's child: ``recsys-dist ARGS`` as the console entry point runs it."""
    os.environ.clear()  # a forkserver's child starts with the server's environment
    os.environ.update(env)
    _import_from(env.get("PYTHONPATH"))
    os.chdir(cwd)
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [str(ROOT / "recsys_dist" / "cli.py"), *args]
    _rank_server_by_fork()
    from recsys_dist.cli import main as cli

    # cli.run: ranks forked on CPU, as for the console command; it leaves with os._exit
    code = _exit_code(cli.run, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_server_by_fork() -> None:
    """Have the rank forkserver of ``start_method: forkserver`` ready as a fork of this clean
    child, not a new interpreter that imports torch and TorchRec again (about 3.4 CPU-seconds
    per launch, paid by every multi-rank ``train`` of the suite).

    The fork waits, with no server yet, until the command asks for one
    (``multiprocessing.forkserver.ensure_running``, from ``recsys_dist.train.launch.start_forkserver``);
    it then takes the launcher's environment, working directory and ``sys.path`` of that moment,
    imports ``RANK_PRELOAD`` and serves, as the server started there would: the ranks are still
    forked from a clean single-threaded child of the launcher, and the launcher's own state (its
    logging levels, signal handlers, threads) never reaches them. A command that asks for no
    server (one rank, a refusal) leaves the fork to exit when the command does. Where this
    Python's ``multiprocessing.forkserver`` is not the one this was written against (3.11's),
    the command starts its own server as before.
    """
    import inspect
    import pickle
    import socket
    from multiprocessing import connection, forkserver, resource_tracker

    server = forkserver._forkserver
    expected = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
    if list(inspect.signature(forkserver.main).parameters) != expected or server._forkserver_pid is not None:
        return
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # as ensure_running's: the server ends when every client has
    state_r, state_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)  # the clients' ends: the server must see them close
            os.close(state_w)
            _serve_ranks(listener, alive_r, state_r)
        finally:
            os._exit(0)
    listener.close()
    os.close(alive_r)
    os.close(state_r)
    original = server.ensure_running

    def ensure_running() -> None:
        if server._forkserver_pid is None:  # the first call: the server starts from here
            resource_tracker.ensure_running()
            with os.fdopen(state_w, "wb") as f:
                pickle.dump((dict(os.environ), os.getcwd(), list(sys.path)), f)
            server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
        original()  # finds it running (or, were it gone, starts one as usual)

    server.ensure_running = forkserver.ensure_running = ensure_running


def _serve_ranks(listener, alive_r: int, state_r: int) -> None:
    """The fork of :func:`_rank_server_by_fork`: wait for the launcher's state, then serve."""
    import pickle
    from multiprocessing import forkserver

    from recsys_dist.train.launch import RANK_PRELOAD

    with os.fdopen(state_r, "rb") as f:
        data = f.read()
    if not data:  # the command ended without asking for a server
        return
    env, cwd, path = pickle.loads(data)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    keep = {0, 1, 2, listener.fileno(), alive_r}
    for fd in [int(n) for n in os.listdir("/proc/self/fd")]:  # a new server has only these
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for name in RANK_PRELOAD:  # imported in the child already: as a new server would have them
        __import__(name)
    try:
        forkserver.main(listener.detach(), alive_r, [])
    except SystemExit:  # every client gone
        pass


def _import_from(pythonpath: str | None) -> None:
    """Put ``$PYTHONPATH``'s entries first on ``sys.path``, as a new interpreter would."""
    if pythonpath:
        sys.path[:0] = [p for p in pythonpath.split(os.pathsep) if p and p not in sys.path]


def _exit_code(command, args: list[str]) -> int:
    """``command(args)``'s exit status as the interpreter would give it: its return value, a
    ``SystemExit``'s code (argparse: 2 on a usage error, 0 after --help; a message is printed,
    status 1), or 1 after printing the traceback of an exception."""
    try:
        return command(args) or 0
    except SystemExit as exit_:
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
            return 1
        return exit_.code or 0
    except Exception:
        traceback.print_exc()
        return 1


def _fresh_interpreter_warnings() -> None:
    """Warning filters and output as in a new ``python``: pytest's filterwarnings and its
    recording do not apply to what the command prints."""
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show


def run_train(config, run_dir, *overrides, tmp=None, **kw) -> subprocess.CompletedProcess:
    """``recsys-dist train --config CONFIG --run-dir RUN_DIR OVERRIDES...`` through ``run_cli``
    (``tmp`` and the keywords as there: ``env``, ``inprocess``, ``launcher``, ``timeout``, ``cwd``)."""
    return run_cli(["train", "--config", config, "--run-dir", run_dir, *overrides], tmp, **kw)


def read_metrics(run_dir, split: str | None = None) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl`` in order; with ``split`` only that split's."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows if split is None else [m for m in rows if m["split"] == split]
