"""benchmarks/harness.py: its maths (ABBA order, paired ratios, bootstrap intervals, the growth fit,
the steady rate), the environment record and the results writer's naming and refusals; every
bench answers ``--help`` with the harness's options and none copies the harness; and one bench's
``--smoke`` run through its command line writes its results file."""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import pytest

from benchmarks import harness
from tests.conftest import ROOT


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
