"""Noise (issue 40, item 13): what every rank would say is said once per run (by rank 0), an
error never lands on the line a progress bar holds, and ``recsys-dist preprocess`` converts data
without importing torch, TorchRec or the model zoo."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import QUICKSTART, ROOT
from tests.unit.test_noise import _undeclared


def test_preprocess_imports_no_torch_torchrec_or_model(tmp_path):
    """``recsys-dist preprocess`` (in a fresh interpreter, through the command's own ``main``)
    converts the data and refuses a cross-section problem of the config without importing
    torch, TorchRec, FBGEMM or any model of the zoo (it imported all of them: ~2 s and their
    warnings, for a step that reads and writes files). Nor the user's module of a model and a
    loss named by import path (examples/custom_model: its import imported torch)."""
    custom = ROOT / "examples" / "custom_model"
    code = f"""
import json, sys
from recsys_dist.cli.main import main
codes = [main(["preprocess", "--config", {str(QUICKSTART)!r}, "--quiet", "data.num_rows=500"]),
         main(["preprocess", "--config", {str(QUICKSTART)!r}, "data.num_rows=500", "train.loss_weights.foo=1.0"]),
         main(["preprocess", "--config", {str(custom / "config.yaml")!r}, "--quiet", "data.num_rows=500"])]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu", "my_model")
               or m.startswith("recsys_dist.models.zoo."))
print(json.dumps({{"codes": codes, "heavy": heavy}}))
"""
    env = {
        "PYTHONPATH": f"{ROOT}:{custom}",
        "RECSYS_DIST_CACHE": str(tmp_path / "cache"),
        "PATH": "/usr/bin:/bin",
    }
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["codes"] == [0, 2, 0], r.stdout + r.stderr
    assert "rows: train 400" in r.stdout and "train.loss_weights.foo: no task 'foo'" in r.stderr
    assert out["heavy"] == [], out["heavy"][:20]


# ------------------------------------------------------------------ what the code returns, typed

SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"


# ------------------------------------------------------------------ a 2-rank run, read as a user reads it


def _land(landing, name: str, lines: list[bytes]) -> None:
    """A finished partition (written aside, renamed; an hour old, so settled by any rule)."""
    import os

    target = landing / name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp"
    tmp.write_bytes(b"".join(lines))
    os.replace(tmp, target)
    os.utime(target, (target.stat().st_atime - 3600, target.stat().st_mtime - 3600))


BAR = re.compile(r"train: [^\[]*\[[^\]]*\]")  # tqdm's "train: 31%|###  | 39/125 [00:00<00:01, ...]"


def _messages(stderr: str) -> list[tuple[str, bool]]:
    """(message, glued) for every message of ``stderr``: the text between the ``\r`` a bar
    redraws with and the newline, and whether a bar's text precedes it on its line (a message
    that another process wrote after a bar, or one written after a bar that was not cleared)."""
    out = []
    for line in stderr.split("\n"):
        drawn = False  # text is on this line so far, not blanked out
        for segment in line.split("\r"):
            bar = BAR.match(segment)
            text = segment[bar.end() :] if bar else segment
            if text.strip():
                out.append((text.strip(), drawn or bool(bar)))
            drawn = bool(bar) or bool(text.strip())  # a blank segment (tqdm's clearing) leaves nothing
    return out


def _assert_apart(stderr: str) -> None:
    """No message shares its line with a progress bar's text."""
    glued = [text for text, on_bar in _messages(stderr) if on_bar]
    assert not glued, f"glued to a progress bar: {glued[:3]}"


@pytest.mark.slow
def test_two_ranks_say_each_warning_once_and_never_on_the_bars_line(tmp_path):
    """A 2-rank stream run with a progress bar: the quarantined and the empty partition are each
    reported once (by rank 0: every rank printed them, rank 1's glued to rank 0's bar), and its
    summary holds only keys ``StreamSummary`` names. Then a rank that raises mid-training: its
    traceback and the launcher's report each start on a line of their own."""
    from recsys_dist.train.results import StreamSummary
    from tests.cli import run_train

    lines = SAMPLE.read_bytes().splitlines(keepends=True)
    landing, run = tmp_path / "landing", tmp_path / "run"
    for i in range(2):
        _land(landing, f"day=0/hour=0{i}/part-0.txt", lines[i * 320 : (i + 1) * 320])
    _land(landing, "day=0/hour=02/part-0.txt", [])  # empty
    _land(landing, "day=0/hour=03/part-0.txt", lines[700:720] + [b"garbage\tline\n"])  # malformed
    _land(landing, "day=0/hour=04/part-0.txt", lines[800:1120])
    stream = [
        f"data.stream.path={landing}",
        "data.stream.poll_seconds=0.2",
        "data.stream.stop_after_idle_seconds=0",
        "data.num_embeddings=2000",
        "checkpoint.every_n_steps=5",
    ]
    r = run_train(ROOT / "configs" / "criteo_online.yaml", run, *stream, tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [t for t, _ in _messages(r.stderr) if " recsys_dist: " in t]
    said = [t.split(" recsys_dist: ", 1)[1] for t in logged]  # without the time and the rank
    assert any("day=0/hour=03/part-0.txt is malformed and was quarantined" in s for s in said), r.stderr
    assert any("day=0/hour=02/part-0.txt" in s for s in said), r.stderr
    assert len(said) == len(set(said)), "\n".join(logged)  # once per run, not once per rank
    assert all("[rank 0]" in t for t in logged), "\n".join(logged)
    _assert_apart(r.stderr)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["partitions"][-1] == "day=0/hour=04/part-0.txt" and summary["steps"] == 15
    assert _undeclared(summary, StreamSummary) == set()

    toy = ["data.num_rows=3000", "checkpoint.enabled=false", "train.log_every_n_steps=5"]
    env = {"RECSYS_DIST_FAULT": "raise:12:1"}
    r = run_train(QUICKSTART, tmp_path / "fails", *toy, tmp=tmp_path, env=env)
    assert r.returncode == 1
    assert r.stderr.count("RuntimeError: injected failure on rank 1 at step 12") == 2  # its traceback, the report
    assert "recsys-dist: training failed on rank 1:" in r.stderr
    _assert_apart(r.stderr)
