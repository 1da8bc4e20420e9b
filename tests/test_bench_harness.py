"""benchmarks/harness.py: its maths (ABBA order, paired ratios, bootstrap intervals, the growth fit,
the steady rate), the environment record and the results writer's naming and refusals; every
bench answers ``--help`` with the harness's options and none copies the harness; and one bench's
``--smoke`` run through its command line writes its results file."""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import harness
from tests.conftest import ROOT

BENCHES = {  # every runnable script of benchmarks/ (a new one must use the harness too)
    "coverage_overhead.py",
    "data_pipeline.py",
    "deepctr_compare.py",
    "freshness.py",
    "managed_quality.py",
    "managed_speed.py",
    "model_quality.py",
    "multitask_side_by_side.py",
    "overlap_delay.py",
    "publish_reload.py",
    "qcomms.py",
    "quantize_auc.py",
    "reshard_matrix.py",
    "run.py",
    "sequence_side_by_side.py",
    "serve_flood.py",
    "serve_load.py",
    "serve_slowloris.py",
    "sharding_throughput.py",
    "step_overhead.py",
    "stream_profile.py",
    "stream_throughput.py",
}


def scripts() -> list[Path]:
    return sorted(p for p in (ROOT / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text())


def test_abba_runs_every_contender_once_a_round_in_abba_order():
    calls = []
    contenders = {k: (lambda k=k: calls.append(k) or len(calls)) for k in "abc"}
    seen = []
    got = harness.abba(contenders, 3, on_result=lambda r, name, x: seen.append((r, name, x)))
    assert calls == list("abc" + "cba" + "abc")
    assert got == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}
    assert seen[3] == (1, "c", 4)
    with pytest.raises(ValueError, match="at least one round"):
        harness.abba(contenders, 0)


def test_run_bench_takes_the_bench_protocol():
    class Toy:
        def __init__(self) -> None:
            self.order: list[str] = []

        def contenders(self) -> list[str]:
            return ["on", "off"]

        def run_round(self, contender: str) -> float:
            self.order.append(contender)
            return 2.0 if contender == "on" else 1.0

    toy = Toy()
    got = harness.run_bench(toy, 4)
    assert toy.order == ["on", "off", "off", "on"] * 2
    assert harness.paired_ratio(got["on"], got["off"]) == 2.0


def test_paired_ratio_is_the_median_of_the_ratios_within_rounds():
    a, b = [10.0, 30.0, 90.0], [4.0, 40.0, 10.0]
    assert harness.paired_ratios(a, b) == [2.5, 0.75, 9.0]
    assert harness.paired_ratio(a, b) == 2.5  # not the ratio of the medians, 30 / 10
    assert harness.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    with pytest.raises(ValueError, match="3 rounds of one contender vs 2"):
        harness.paired_ratio(a, b[:2])


def test_bootstrap_interval():
    assert harness.bootstrap_interval([1.2] * 5) == (1.2, 1.2)
    values = [0.9, 1.0, 1.1, 1.2, 1.3, 1.25, 1.15]
    lo, hi = harness.bootstrap_interval(values, n=500)
    assert min(values) <= lo <= harness.median(values) <= hi <= max(values)
    assert harness.bootstrap_interval(values, n=500) == (lo, hi)  # seeded
    lo_mean, hi_mean = harness.bootstrap_interval(values, stat=lambda x: sum(x) / len(x), n=500)
    assert lo_mean < sum(values) / len(values) < hi_mean
    assert harness.ratio_interval([2.0, 4.0], [1.0, 2.0]) == "[2.000, 2.000]"


def test_paired_bootstrap_of_a_metric_difference():
    import numpy as np
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 400)
    good = [labels + rng.normal(0, 0.5, 400) for _ in range(2)]  # two seeds of a model that ranks well
    noise = [rng.normal(0, 1, 400) for _ in range(2)]
    point, (lo, hi) = harness.paired_bootstrap(labels, good, noise, roc_auc_score, n=200)
    want = np.mean([roc_auc_score(labels, g) - roc_auc_score(labels, x) for g, x in zip(good, noise)])
    assert point == pytest.approx(want) and 0 < lo < point < hi
    same, interval = harness.paired_bootstrap(labels, good, good, roc_auc_score, n=50)
    assert same == 0.0 and interval == [0.0, 0.0]
    with pytest.raises(ValueError, match="2 runs of one variant vs 1"):
        harness.paired_bootstrap(labels, good, noise[:1], roc_auc_score)


def test_fit_exponent():
    xs = [1e4, 1e5, 1e6]
    assert math.isclose(harness.fit_exponent(xs, [3 * x for x in xs]), 1.0)
    assert math.isclose(harness.fit_exponent(xs, [5.0] * 3), 0.0, abs_tol=1e-12)
    assert math.isclose(harness.fit_exponent(xs, [x**0.5 for x in xs]), 0.5)
    assert math.isnan(harness.fit_exponent([10.0, 10.0], [1.0, 2.0]))


def test_steady_rate_leaves_out_the_first_window():
    # windows of 10 steps x 64 rows; the first (the pipeline's fill and trace) is slow
    lines = [{"split": "ledger"}] + [
        {"split": "train", "step": s, "samples_per_s": r} for s, r in ((10, 100.0), (20, 2000.0), (30, 1000.0))
    ]
    assert harness.steady_rate(lines, 64) == round(1280 / (640 / 2000 + 640 / 1000), 1)
    with pytest.raises(SystemExit, match="fewer than two train log lines"):
        harness.steady_rate(lines[:2], 64)


def machine(gpus: list[str], cores: int = 2) -> dict:
    return {"utc": "2026-12-04 23:59:59", "machine": {"gpus": gpus, "cores": cores}}


def test_hardware_tag_and_results_name():
    assert harness.hardware_tag(machine([])) == "cpu2core"
    assert harness.hardware_tag(machine([], 16)) == "cpu16core"
    assert harness.hardware_tag(machine(["NVIDIA H200"])) == "h200"
    assert harness.hardware_tag(machine(["NVIDIA H200"] * 8)) == "h200x8"
    assert harness.hardware_tag(machine(["NVIDIA A100-SXM4-80GB"])) == "a100"
    path = harness.results_path("step_overhead_ab", machine([]))
    assert path == ROOT / "benchmarks" / "results" / "step_overhead_ab_cpu2core_20261204.md"


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


def test_command_line_is_the_command_as_typed_from_the_root(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "run.py"), "--quick", "--skip", "3,5"])
    monkeypatch.setattr(sys, "executable", str(ROOT / ".venv" / "bin" / "python"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(ROOT)
    assert harness.command_line() == "PYTHONPATH=$PWD .venv/bin/python benchmarks/run.py --quick --skip 3,5"
    assert harness.command_line(["--reps", "a b"]).endswith("benchmarks/run.py --reps 'a b'")
    monkeypatch.delenv("PYTHONPATH")
    monkeypatch.chdir(ROOT / "benchmarks")
    assert harness.command_line([]) == f"cd {ROOT / 'benchmarks'} && .venv/bin/python benchmarks/run.py"


def test_render_keeps_tables_and_fences_the_rest():
    out = "setup: x\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n\nrounds 1/2\n"
    assert (
        harness.render(out)
        == "```text\nsetup: x\n```\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n\n```text\nrounds 1/2\n```"
    )


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


def test_benches_use_the_harness_and_copy_none_of_it():
    copied = ("def paired", "def paired_bootstrap", "def recsys_dist(", "def _free_port", "def exponent(")
    for path in (ROOT / "benchmarks").glob("*.py"):
        text = path.read_text()
        assert "sys.path.insert" not in text, path.name
        if path.name != "harness.py":
            assert not [c for c in copied if c in text], path.name
        if path.name not in ("harness.py", "netns.py", "servers.py"):  # one way to start a process
            assert not [c for c in ("subprocess.run(", "subprocess.Popen(", "sys.executable") if c in text], path.name
    for path in scripts():
        text = path.read_text()
        assert "harness.parser(" in text and "harness.Results(" in text, path.name


def test_the_library_never_imports_benchmarks():
    found = []
    for path in (ROOT / "recsys_dist").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("benchmarks", "harness")]
    assert not found, found


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
