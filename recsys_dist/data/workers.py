"""Worker processes that apply one function to a stream of items, results in input order.

Used by conversion to convert several raw files at once, one file per worker (see
``convert._convert_in_workers``); a worker returns small summaries, never the data. The workers are plain
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
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

_HEADER = struct.Struct("<Q")


class WorkerDied(RuntimeError):
    """A worker process ended without answering (killed, out of memory)."""


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
    exception raised by ``fn`` is re-raised here, in order (so the first bad block of a file
    is the one reported); the items after it are not waited for.

    Raises:
        WorkerDied: a worker exited without answering (its exit code in the message).
    """

    def __init__(self, n: int, fn: Callable) -> None:
        self.procs: list = []
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.procs = [subprocess.Popen([sys.executable, "-m", "recsys_dist.data.workers"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env) for _ in range(n)]
        for p in self.procs:
            _send(p.stdin, fn)

    def map(self, items: Iterable[tuple]) -> Iterator[tuple[tuple, Any]]:
        n, sent = len(self.procs), []
        it = iter(items)
        for k, item in zip(range(n), it):
            _send(self.procs[k].stdin, item)
            sent.append(item)
        k = 0
        while k < len(sent):
            proc = self.procs[k % n]
            result = self._result(proc)
            nxt = next(it, None)
            if nxt is not None:
                _send(proc.stdin, nxt)
                sent.append(nxt)
            yield sent[k], result
            sent[k] = None  # the item is the caller's now; do not keep it alive
            k += 1

    def _result(self, proc: subprocess.Popen):
        try:
            status, value = _recv(proc.stdout)
        except EOFError:
            raise WorkerDied(f"a conversion worker process ended without answering (exit code {proc.wait()}; "
                             "out of memory?)") from None
        if status == "err":
            raise value
        return value

    def __enter__(self) -> "OrderedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
