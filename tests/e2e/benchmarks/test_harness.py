"""benchmarks/harness.py: its maths (ABBA order, paired ratios, bootstrap intervals, the growth fit,
the steady rate), the environment record and the results writer's naming and refusals; every
bench answers ``--help`` with the harness's options and none copies the harness; and one bench's
``--smoke`` run through its command line writes its results file."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import harness
from tests.conftest import ROOT
from tests.unit.benchmarks.test_harness import scripts

BENCHES = {  # every runnable script of benchmarks/ (a new one must use the harness too)
    "coverage_overhead.py",
    "data_pipeline.py",
    "deepctr_compare.py",
    "dense_layouts.py",
    "fsdp_profile.py",
    "freshness.py",
    "history_state_size.py",
    "hstu_jagged.py",
    "hstu_retrieval.py",
    "hstu_retrieval_compare.py",
    "managed_quality.py",
    "managed_speed.py",
    "model_quality.py",
    "multitask_side_by_side.py",
    "overlap_delay.py",
    "pipeline_bubble.py",
    "publish_reload.py",
    "qcomms.py",
    "quantize_auc.py",
    "replica_groups.py",
    "reshard_matrix.py",
    "run.py",
    "sequence_cost.py",
    "sequence_side_by_side.py",
    "serve_flood.py",
    "serve_load.py",
    "serve_slowloris.py",
    "sharding_throughput.py",
    "step_overhead.py",
    "stream_profile.py",
    "stream_throughput.py",
    "two_bw.py",
}


def test_environment_records_machine_versions_commit_and_utc():
    env = harness.environment()
    m, s = env["machine"], env["software"]
    assert m["cores"] == os.cpu_count() and m["memory_gib"] and m["cpu"] and isinstance(m["gpus"], list)
    assert s["python"].startswith("3.") and s["torch"].startswith("2.") and "torchrec" in s
    assert {"fbgemm-gpu", "fbgemm-gpu-cpu"} & set(s)
    assert re.fullmatch(r"[0-9a-f]{12}( \+ uncommitted changes)?", env["commit"]), env["commit"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", env["utc"])
    text = "\n".join(harness.describe(env, env))
    assert f"{m['cores']} cores" in text and "torch " in text and env["commit"] in text and "at the end" in text


def options(tmp_path: Path, **kw) -> argparse.Namespace:
    return argparse.Namespace(**{"smoke": False, "record": "toy", "results_dir": tmp_path, **kw})


def test_results_writes_once_and_refuses_what_it_must_not_write(tmp_path, capsys):
    with harness.Results(options(tmp_path), ["--record", "toy"], title="toy bench") as res:
        print("| x | y |\n| --- | --- |\n| 1 | 2 |")
    text = res.path.read_text()
    assert res.path == harness.results_path("toy", res.env, tmp_path) and res.path.parent == tmp_path
    assert text.startswith("# toy bench\n") and "--record toy`" in text and "| 1 | 2 |" in text
    assert f"recorded: {res.path}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="never overwritten"):  # a new run gets a new file
        harness.Results(options(tmp_path))
    assert res.path.read_text() == text
    with pytest.raises(SystemExit, match="--smoke"):  # smoke numbers are no results
        harness.Results(options(harness.RESULTS, smoke=True))
    with pytest.raises(RuntimeError), harness.Results(options(tmp_path, record="failed")):
        raise RuntimeError("the bench failed: nothing is recorded")
    assert not list(tmp_path.glob("failed_*"))
    with harness.Results(options(tmp_path, record=None)):  # without --record: prints only
        print("x")
    assert len(list(tmp_path.iterdir())) == 1


def test_every_bench_answers_help_with_the_harness_options():
    """``python benchmarks/X.py --help`` for every bench, all at once: exit 0, the harness's
    options listed, fast (heavy imports wait for the run)."""
    found = {p.name for p in scripts()}
    assert found == BENCHES, f"benches changed: new {found - BENCHES}, gone {BENCHES - found}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    procs = {
        name: subprocess.Popen(
            [sys.executable, f"benchmarks/{name}", "--help"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in sorted(found)
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name} --help: {err[-2000:]}"
        assert "--smoke" in out and "--record" in out and "benchmarks/harness.py" in out, name
    assert time.perf_counter() - t0 < 60


def test_a_smoke_run_records_its_results_file(tmp_path):
    """coverage_overhead.py --smoke through its command line: the file the harness names holds
    the command, the environment and the output; a second run is refused, the file unchanged."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "benchmarks/coverage_overhead.py", "--smoke", "--record", "--results-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    assert re.fullmatch(r"coverage_overhead_(cpu\d+core|[a-z0-9]+)_20\d{6}\.md", path.name), path.name
    text = path.read_text()
    assert "--smoke --record --results-dir" in text and "benchmarks/coverage_overhead.py" in text
    for words in ("**Machine:**", "torch 2.", "torchrec ", "**Commit:**", "**Time (UTC):**", "CPU ratio on/off: "):
        assert words in text, words
    ratio = float(text.split("CPU ratio on/off: ")[1].split()[0])
    assert ratio > 0 and "rows 3,000" in done.stdout
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode != 0 and "never overwritten" in again.stderr and path.read_text() == text
