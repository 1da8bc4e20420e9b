"""The unit tier: tests that start no process, run no CLI command, start no ranks and train no
model, so that ``make test-fast`` (``pytest tests/unit``) answers in seconds.

A hook enforces it: while a test here sets up, runs and tears down, every way to start a
process (``subprocess``, ``multiprocessing`` / ``torch.multiprocessing``, ``os.fork``,
``os.system``, ``os.posix_spawn``), ``recsys_dist.testing.run_ranks``, ``recsys_dist.launch``,
a CLI command (``recsys_dist.cli.main``, ``tests.cli.run_cli``) and a training run
(``Trainer.fit`` / ``train_epoch``, ``StreamTrainer.fit``) is replaced by a refusal, and the
test fails naming what it started and where it belongs: ``tests/ranks/`` (ranks) or
``tests/e2e/`` (CLI runs, processes, training). The refusal is a ``BaseException``, and it is
also reported after the test, so code under test that catches ``Exception`` cannot hide it.
"""

from __future__ import annotations

import importlib
import sys
from functools import wraps

import pytest


class UnitTierViolation(BaseException):
    """A unit test started a process, a CLI command, ranks or a training run."""


# (module, class or None, attribute, what it starts)
REFUSED = [
    ("subprocess", "Popen", "_execute_child", "a subprocess"),
    ("multiprocessing.process", "BaseProcess", "start", "a process (multiprocessing / torch.multiprocessing)"),
    ("os", None, "fork", "a process (os.fork)"),
    ("os", None, "system", "a process (os.system)"),
    ("os", None, "posix_spawn", "a process (os.posix_spawn)"),
    ("os", None, "posix_spawnp", "a process (os.posix_spawnp)"),
    ("recsys_dist.testing", None, "run_ranks", "ranks (recsys_dist.testing.run_ranks)"),
    ("recsys_dist.train.launch", None, "launch", "ranks (recsys_dist.launch)"),
    ("recsys_dist.cli.main", None, "command", "a CLI command (recsys_dist.cli.main)"),
    ("tests.cli", None, "_in_process", "a CLI command (tests.cli.run_cli)"),
    ("recsys_dist.train.trainer", "Trainer", "fit", "a training run (Trainer.fit)"),
    ("recsys_dist.train.trainer", "Trainer", "train_epoch", "a training run (Trainer.train_epoch)"),
    ("recsys_dist.train.stream", "StreamTrainer", "fit", "a training run (StreamTrainer.fit)"),
]
# Frames named in a refusal: the helper through which the test reached it.
VIA = ("recsys_dist.testing", "tests.cli", "recsys_dist.train.launch", "recsys_dist.cli.main")


def _targets():
    for module, owner, attr, what in REFUSED:
        try:
            obj = importlib.import_module(module)
            obj = getattr(obj, owner) if owner else obj
        except (ImportError, AttributeError):
            continue  # renamed or gone: the process guards still hold
        if hasattr(obj, attr):
            yield obj, attr, what


def _via() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name in VIA:
            return f" (through {name}.{frame.f_code.co_name})"
        frame = frame.f_back
    return ""


def _install(item, violations: list[str]) -> list:
    saved = []
    for owner, attr, what in _targets():
        original = vars(owner)[attr] if attr in vars(owner) else getattr(owner, attr)

        @wraps(getattr(owner, attr))
        def refuse(*args, _what=what, **kwargs):
            message = (
                f"{item.nodeid}: a unit test may not start {_what}{_via()}; "
                "move it to tests/ranks/ (ranks) or tests/e2e/ (CLI runs, processes, training)"
            )
            violations.append(message)
            raise UnitTierViolation(message)

        saved.append((owner, attr, original if attr in vars(owner) else None))  # None: inherited
        setattr(owner, attr, refuse)
    return saved


def _uninstall(saved: list) -> None:
    for owner, attr, original in reversed(saved):
        if original is None:  # inherited (StreamTrainer.fit is Trainer.fit): the subclass gets its parent's back
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)


def _guarded(item):
    violations: list[str] = []
    saved = _install(item, violations)
    try:
        return (yield)
    finally:
        _uninstall(saved)
        if violations:
            pytest.fail(violations[0], pytrace=False)


# Setup and teardown too: a fixture of any scope that starts a process breaks the tier as well.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded(item))
