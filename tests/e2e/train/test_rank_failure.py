"""The launcher's report of a failed rank (recsys_dist.train.rank_failure), without starting ranks:
a SIGKILLed rank is named before the peers that only lost their connection to it, the
signal and the out-of-memory killer are named, and the command to continue is printed."""

import subprocess
import sys

from tests.conftest import ROOT
from tests.unit.train.test_rank_failure import LOST

_SURVIVOR = """
import recsys_dist.train.worker as worker
def train(job, run):
    raise RuntimeError(%r)
worker._rank_code = train
worker.LOST_PEER_GRACE_S = 0.1  # (5 s: the launcher stops it before then, having seen the dead peer)
worker.rank_main(None, None)
"""


def test_a_rank_that_lost_its_peer_prints_one_line_not_its_traceback():
    """The survivor of a SIGKILLed peer printed a ~50-110 line traceback of the collective."""
    code = _SURVIVOR % LOST.removeprefix("RuntimeError: ")
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env={"RANK": "0", "PATH": ""}
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "recsys-dist: rank 0 stopped: it lost its connection to another rank ("
        + LOST.removeprefix("RuntimeError: ")
        + ")"
    ]
