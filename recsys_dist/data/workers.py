"""Worker processes that apply one function to a stream of items, results in input order.

Used by conversion to convert several raw files at once, one file per worker (see
``convert.parallel.convert_in_workers``); a worker returns small summaries, never the data. The workers are plain
``python -m recsys_dist.data.workers`` subprocesses talking pickle frames over their
stdin / stdout, not ``multiprocessing``: its spawn start re-runs the caller's main script in
every worker (an unguarded script or a notebook would convert, or train, again in each), and
fork copies a process that may hold torch's and pyarrow's threads.

Each worker has one item at a time; item ``k`` goes to worker ``k mod n``, so reading the
results in order never leaves a worker blocked on a full pipe while we write to it.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from recsys_dist.errors import WorkerDied  # noqa: F401 (raised here; defined in errors)

_HEADER = struct.Struct("<Q")


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _recv(stream):
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


class OrderedPool:
    """``n`` worker processes applying ``fn(*item)``; ``fn`` is pickled once per worker.

    Use as a context manager; :meth:`map` yields ``(item, fn(*item))`` in input order. An
    exception raised by ``fn`` is re-raised here, in order (so the first bad file of a list is
    the one reported); the items after it are not waited for. While the pool is open in the
    main thread, SIGTERM raises ``SystemExit(143)`` here, so the workers are stopped on the way
    out as on Ctrl-C.

    Raises:
        WorkerDied: a worker exited without answering (its exit code and item in the message).
    """

    def __init__(self, n: int, fn: Callable) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.procs: list[subprocess.Popen] = []
        self._old_sigterm = None
        try:
            for _ in range(n):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "recsys_dist.data.workers"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        env=env,
                    )
                )
            for p in self.procs:
                self._give(p, fn, "its function")
        except BaseException:
            self.close()
            raise

    def map(self, items: Iterable[tuple]) -> Iterator[tuple[tuple, Any]]:
        n, sent = len(self.procs), []
        it = iter(items)
        for k, item in zip(range(n), it):
            self._give(self.procs[k], item, item)
            sent.append(item)
        k = 0
        while k < len(sent):
            proc = self.procs[k % n]
            result = self._result(proc, sent[k])
            nxt = next(it, None)
            if nxt is not None:
                self._give(proc, nxt, nxt)
                sent.append(nxt)
            yield sent[k], result
            sent[k] = None  # the item is the caller's now; do not keep it alive
            k += 1

    @staticmethod
    def _give(proc: subprocess.Popen, obj, what) -> None:
        try:
            _send(proc.stdin, obj)
        except (BrokenPipeError, OSError):
            raise WorkerDied(f"a worker process ended before taking {_short(what)} (exit code {proc.wait()})") from None

    @staticmethod
    def _result(proc: subprocess.Popen, item):
        try:
            status, value = _recv(proc.stdout)
        except EOFError:
            raise WorkerDied(
                f"a worker process ended without answering for {_short(item)} (exit code {proc.wait()}; out of memory?)"
            ) from None
        if status == "err":
            raise value
        return value

    def __enter__(self) -> OrderedPool:
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_exits)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)

    def close(self) -> None:
        """Stop the workers; one busy with an item gets a broken pipe on answering and exits."""
        for p in self.procs:
            for stream in (p.stdin, p.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _sigterm_exits(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _short(item) -> str:
    text = repr(item[0] if isinstance(item, tuple) and item else item)
    return text if len(text) <= 120 else text[:117] + "..."


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the parent process dies (even by SIGKILL), instead of converting
    on for nobody; elsewhere the closed pipe stops us after the current item."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _serve() -> None:
    # Ctrl-C reaches the whole process group: the parent handles it (and closes our pipes, so
    # we stop at the next item); a traceback from every worker would only bury its message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    # Our stdout carries the frames: anything the function prints goes to stderr instead.
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        fn = _recv(inp)
    except EOFError:
        return
    while True:
        try:
            item = _recv(inp)
        except EOFError:
            return
        try:
            reply = ("ok", fn(*item))
        except Exception as err:  # noqa: BLE001 - re-raised by the caller, in order
            reply = ("err", err)
        try:
            _send(out, reply)
        except BrokenPipeError:
            return


if __name__ == "__main__":
    _serve()
