"""The unit tier's guard (tests/unit/conftest.py): each way to start a process, a CLI command,
ranks or a training run is refused, named, and put back afterwards."""

import multiprocessing
import subprocess
import sys

import pytest

from recsys_dist.cli import main as cli
from recsys_dist.testing import run_ranks
from recsys_dist.train.trainer import Trainer
from tests.cli import run_cli
from tests.unit import conftest as tier


class Item:
    nodeid = "tests/unit/test_x.py::test_y"


def _rank(rank, world_size):
    return rank


STARTS = {
    "a subprocess": lambda: subprocess.run([sys.executable, "-c", "pass"], check=False),
    "a process (multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    "a process (os.fork)": lambda: __import__("os").fork(),
    "(through recsys_dist.testing.run_ranks)": lambda: run_ranks(_rank, 2),
    "a CLI command (tests.cli.run_cli)": lambda: run_cli(["report", "nowhere"]),
    "a CLI command (recsys_dist.cli.main)": lambda: cli.main(["report", "nowhere"]),
    "a training run (Trainer.fit)": lambda: Trainer.fit(None),
}


@pytest.mark.parametrize("named", STARTS)
def test_each_start_is_refused_and_named(named):
    violations: list[str] = []
    saved = tier._install(Item, violations)
    try:
        with pytest.raises(tier.UnitTierViolation, match="tests/unit/test_x.py::test_y: a unit test may not start"):
            STARTS[named]()
    finally:
        tier._uninstall(saved)
    assert len(violations) == 1 and named in violations[0], violations
    assert "tests/ranks/" in violations[0] and "tests/e2e/" in violations[0]


def test_what_was_replaced_is_put_back():
    before = {(id(o), a): getattr(o, a) for o, a, _ in tier._targets()}
    tier._uninstall(tier._install(Item, []))
    assert {(id(o), a): getattr(o, a) for o, a, _ in tier._targets()} == before
    assert Trainer.fit.__doc__ and Trainer.fit.__name__ == "fit"
