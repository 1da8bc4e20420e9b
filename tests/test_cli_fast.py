"""``recsys-dist --help``, a usage error and a config error answer before torch loads (importing
torch and TorchRec took 5-20 s of a 2-core machine's time before the first line of help).

Each case runs ``recsys_dist.cli.main.main`` in a fresh interpreter and reports whether
``torch`` is in ``sys.modules`` when the command has answered.
"""

import json
import subprocess
import sys

import pytest

from tests.conftest import QUICKSTART, ROOT

_WRAPPER = """
import json, sys
from recsys_dist.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
sys.stderr.write("\\n" + json.dumps({"code": code, "torch": "torch" in sys.modules}) + "\\n")
"""


def _answer(*argv) -> tuple[dict, str, str]:
    """(``{"code": exit code, "torch": loaded}``, stdout, stderr) of ``recsys-dist ARGV``."""
    r = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *map(str, argv)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    lines = r.stderr.strip().splitlines()
    assert lines, r
    return json.loads(lines[-1]), r.stdout, r.stderr


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--help"], ["plan", "--help"], ["predict", "--help"], ["report", "--help"]],
    ids=" ".join,
)
def test_help_answers_without_importing_torch(argv):
    result, out, _ = _answer(*argv)
    assert result == {"code": 0, "torch": False}
    assert "usage: recsys-dist" in out


def test_a_usage_error_answers_without_importing_torch():
    result, _, err = _answer("evaluate")
    assert result == {"code": 2, "torch": False}
    assert "the following arguments are required" in err
    result, _, err = _answer("train", "--config", QUICKSTART, "--no-such-flag")
    assert result == {"code": 2, "torch": False}
    assert "unrecognized arguments: --no-such-flag" in err


@pytest.mark.parametrize("override", ["train.batch_size=-1", "train.no_such_key=1"])
def test_a_config_error_answers_without_importing_torch(override):
    result, _, err = _answer("train", "--config", QUICKSTART, override)
    assert result == {"code": 2, "torch": False}
    assert "train." in err and "Traceback" not in err
