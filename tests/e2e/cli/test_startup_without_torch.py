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


def test_bench_has_no_machine_specific_deepctr_python(tmp_path, monkeypatch, capsys):
    """``recsys-dist bench --deepctr-python`` defaulted to one machine's venv path; now it has
    no default (item 3 is skipped and says how to make the venv), takes a path or a command on
    PATH, refuses one that is neither, and is passed to benchmarks/run.py only when given."""
    from recsys_dist.cli import bench
    from recsys_dist.cli.main import build_parser

    ran = []
    monkeypatch.setattr(
        bench.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0)
    )
    assert bench.cmd_bench(build_parser().parse_args(["bench", "--quick"])) == 0
    assert "--deepctr-python" not in ran[-1]
    monkeypatch.setenv("PATH", str(tmp_path))
    python = tmp_path / "dctr-python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    for given in (str(python), "dctr-python"):
        assert bench.cmd_bench(build_parser().parse_args(["bench", "--deepctr-python", given])) == 0
        assert ran[-1][ran[-1].index("--deepctr-python") + 1] == str(python)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--deepctr-python", str(tmp_path / "no_such_python")])
    assert (
        f"{tmp_path / 'no_such_python'} is neither an executable file nor a command on PATH" in capsys.readouterr().err
    )
