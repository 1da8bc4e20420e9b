"""Runs every case of ``corpus*.yaml`` (the format is described at the top of corpus.yaml): the command, its exit code and message, under a timeout.

Cases that stop before any rank is spawned run in-process through ``recsys_dist.cli.main.main``
(fast); ``spawn: true`` cases run the real command in a subprocess and are marked slow.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recsys_dist.cli import main as cli
from tests.conftest import QUICKSTART, ROOT, base_row

CORPUS = [
    case for path in sorted(Path(__file__).parent.glob("corpus*.yaml")) for case in yaml.safe_load(path.read_text())
]
PLACES = {
    "quickstart": str(QUICKSTART),
    "mlperf": str(ROOT / "configs" / "mlperf_dlrmv2.yaml"),
    "online": str(ROOT / "configs" / "criteo_online.yaml"),
}
COLUMNS = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


def _row(spec: str) -> str:
    """``base`` plus edits: ``COL=VALUE``, ``-label`` (drop the label), ``+VALUE`` (append),
    ``<N`` (keep the first N fields: a line without its trailing fields)."""
    words = spec.split()
    assert words[0] == "base", spec
    fields = base_row().split("\t")
    extra, drop, keep = [], False, None
    for w in words[1:]:
        if w == "-label":
            drop = True
        elif w.startswith("+"):
            extra.append(w[1:])
        elif w.startswith("<"):
            keep = int(w[1:])
        else:
            col, value = w.split("=", 1)
            fields[COLUMNS.index(col)] = value
    return "\t".join(((fields[1:] if drop else fields) + extra)[:keep])


def _write_files(case: dict, tmp: Path) -> None:
    for name, spec in (case.get("files") or {}).items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = spec["text"] if "text" in spec else "".join(_row(r) + "\n" for r in spec["rows"])
        path.write_text(text)


def _params():
    for case in CORPUS:
        marks = [pytest.mark.timeout(case["timeout"])] + ([pytest.mark.slow] if case.get("spawn") else [])
        yield pytest.param(case, id=case["name"], marks=marks)


@pytest.mark.parametrize("case", _params())
def test_case(case, tmp_path, monkeypatch, capsys):
    _write_files(case, tmp_path)
    argv = [a.format(tmp=tmp_path, **PLACES) for a in case["argv"]]
    env = {"RECSYS_DIST_CACHE": str(tmp_path / "cache"), **(case.get("env") or {})}
    if case.get("spawn"):
        r = subprocess.run(
            [sys.executable, "-m", "recsys_dist.cli.main", *argv],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=case["timeout"],
        )
        code, out, err = r.returncode, r.stdout, r.stderr
    else:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.chdir(tmp_path)
        code = cli.main(argv)
        out, err = capsys.readouterr()
    assert code == case["exit"], f"exit {code}, stderr:\n{err[-3000:]}"
    for words in (w.format(tmp=tmp_path) for w in case.get("expect", [])):
        assert words in err, f"{words!r} not in stderr:\n{err[-3000:]}"
    for words in case.get("stdout", []):
        assert words in out, f"{words!r} not in stdout:\n{out[-3000:]}"
    for words in case.get("forbid", ["Traceback"]):
        assert words not in err + out, f"{words!r} appeared:\n{err[-3000:]}"
    if "latest" in case:
        latest = tmp_path / "run" / "checkpoints" / "latest"
        assert latest.read_text().strip() == case["latest"]
        assert not list(latest.parent.glob("*.tmp")), "a partial checkpoint was left behind"
