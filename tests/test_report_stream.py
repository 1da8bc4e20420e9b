"""``recsys-dist report`` / ``compare`` of data.stream runs: one real run (2 partitions and a
quarantined one, 1 rank) and synthetic metrics.jsonl files (many partitions, managed tables, a
run without summary.json)."""

import json

import pytest

from recsys_dist.cli import main as cli
from recsys_dist.cli import report as rpt
from tests.cli import read_metrics, run_train
from tests.training.test_stream import BAD, CONFIG, NAMES, ROWS, land, overrides

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COUNTERS = ("admitted", "evicted", "evicted_ttl", "collided")


def table_rows(text: str, header: str) -> list[list[str]]:
    """The rows (split on whitespace) of the table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("    ") or line.startswith("     "):
            break
        rows.append(line.split())
    return rows


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory):
    """A real stream run: partitions 00 and 01 trained, 01/part-1 quarantined, stopped idle."""
    tmp = tmp_path_factory.mktemp("report_stream")
    for name in [*NAMES[:2], BAD]:
        land(tmp / "landing", name)
    run = tmp / "run"
    extra = {
        "distributed.nproc_per_node": "1",
        "publish.enabled": "false",
        "publish.every_partition": "false",
        "checkpoint.enabled": "false",
    }
    r = run_train(CONFIG, run, *overrides(tmp / "landing", **extra), tmp=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.mark.slow
def test_report_of_a_real_stream_run_shows_its_partitions(stream_run, tmp_path):
    text = rpt.report(stream_run, out_dir=tmp_path / "plots")
    assert "unreadable" not in text
    assert not any(line.strip().startswith(("test", "validation")) for line in text.splitlines())
    assert "stream: 2 partition(s) trained, 1 quarantined; stopped: idle" in text
    assert f"quarantined {BAD}: line 3: expected 40 fields, got 12" in text
    val = {r["partition"]: r for r in read_metrics(stream_run, "validation")}
    part = {r["partition"]: r for r in read_metrics(stream_run, "partition")}
    rows = table_rows(text, "partition ")
    assert [r[0] for r in rows] == NAMES[:2]
    for row, name in zip(rows, NAMES[:2]):
        v = val[name]
        expect = [str(part[name]["step"]), str(ROWS), f"{v['auc']:.4f}", f"{v['logloss']:.4f}", f"{v['ne']:.4f}"]
        assert row[1:6] == expect
    # the pooled line: the partitions' values weighted by the rows each was scored on
    n = sum(val[p]["num_examples"] for p in NAMES[:2])
    auc = sum(val[p]["auc"] * val[p]["num_examples"] for p in NAMES[:2]) / n
    assert f"{n:,} rows; row-weighted means of the partitions' values): AUC {auc:.4f}" in text
    assert (tmp_path / "plots" / "progressive.png").read_bytes()[:8] == PNG_MAGIC
    assert str(tmp_path / "plots" / "progressive.png") in text
    assert not (tmp_path / "plots" / "validation.png").exists()  # progressive.png shows those lines


def write_stream(path, n: int, *, managed: bool = False, summary: bool = True, unfinished: bool = False):
    """A synthetic stream run of ``n`` partitions of 100 + i rows (AUC 0.6 + i / 1000)."""
    path.mkdir(parents=True)
    lines, names = [{"split": "ledger", "step": 0, "per_rank": []}], [f"hour={i:03d}/part.txt" for i in range(n)]
    for i, name in enumerate(names):
        step = 10 * i
        metrics = {"auc": 0.6 + i / 1000, "logloss": 0.5 - i / 1000, "ne": 0.9, "calibration": 1.0, "accuracy": 0.7}
        lines.append({"split": "validation", "step": step, "partition": name, **metrics, "num_examples": 100 + i})
        lines.append({"split": "train", "step": step + 5, "loss": 0.5})
        part = {"split": "partition", "step": step + 10, "partition": name, "rows": 100 + i, "steps": 10}
        part["seconds"] = 1.5
        if managed:
            part["managed"] = {f: {k: i + j + 1 for j, k in enumerate(COUNTERS)} for f in ("C1", "C2")}
        lines.append(part)
    lines.append(
        {
            "split": "quarantine",
            "step": 10 * n,
            "partition": "hour=bad/x.txt",
            "error": "/l/hour=bad/x.txt, line 2: bad",
        }
    )
    if unfinished:
        lines.append(
            {"split": "validation", "step": 10 * n, "partition": "hour=zzz/part.txt", "auc": 0.5, "num_examples": 7}
        )
    lines.append({"split": "someday", "step": 1})  # a split no version writes: still counted
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if summary:
        s = {"steps": 10 * n, "rows_trained": 5, "partitions": names, "quarantined": {"hour=bad/x.txt": "bad"}}
        (path / "summary.json").write_text(json.dumps({**s, "stopped": "max_steps", "test": {"auc": None}}))
    return path, names


def test_many_partitions_are_elided_and_managed_counters_summed(tmp_path):
    run, names = write_stream(tmp_path / "run", 30, managed=True)
    text = rpt.report(run, plots=False)
    assert "skipped 1 unreadable line(s)" in text  # the unknown split only
    assert "stream: 30 partition(s) trained, 1 quarantined; stopped: max_steps (train.max_steps reached)" in text
    rows = table_rows(text, "partition ")
    assert [r[0] for r in rows] == [*names[:5], "...", *names[-5:]]
    assert rows[5] == ["...", "20", "more"]
    assert table_rows(text, "partition ")[0][0] == names[0]
    header = next(line.split() for line in text.splitlines() if line.strip().startswith("partition "))
    assert header[-4:] == list(COUNTERS)
    last = rows[-1]  # partition 29: each counter summed over C1 and C2
    assert last[-4:] == [str(2 * (29 + j + 1)) for j in range(4)]
    assert last[1:3] == ["300", "129"] and last[3] == "0.6290"
    auc = sum((0.6 + i / 1000) * (100 + i) for i in range(30)) / sum(100 + i for i in range(30))
    assert f"AUC {auc:.4f}" in text


def test_stream_run_without_summary_and_an_unfinished_partition(tmp_path):
    run, names = write_stream(tmp_path / "run", 2, summary=False, unfinished=True)
    text = rpt.report(run, out_dir=tmp_path / "plots")
    assert "stream: 2 partition(s) trained, 1 quarantined; stopped: n/a (no summary.json)" in text
    assert "quarantined hour=bad/x.txt: line 2: bad" in text
    rows = table_rows(text, "partition ")
    assert [r[0] for r in rows] == [*names, "hour=zzz/part.txt"]
    assert rows[-1][1:5] == ["(unfinished)", "20", "n/a", "0.5000"]
    assert (tmp_path / "plots" / "progressive.png").read_bytes()[:8] == PNG_MAGIC


def test_compare_stream_runs_sets_progressive_metrics_side_by_side(tmp_path, capsys):
    a, _ = write_stream(tmp_path / "a", 2)
    b, _ = write_stream(tmp_path / "b", 4)
    assert cli.main(["compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    row = lambda label: next(line.split() for line in text.splitlines() if line.strip().startswith(label))  # noqa: E731
    assert row("partitions trained")[2:] == ["2", "4", "+2"]
    auc_a = (0.6 * 100 + 0.601 * 101) / 201
    auc_b = sum((0.6 + i / 1000) * (100 + i) for i in range(4)) / sum(100 + i for i in range(4))
    assert row("progressive auc")[2:] == [f"{auc_a:.4f}", f"{auc_b:.4f}", f"{auc_b - auc_a:+.4f}"]
    assert not any(line.strip().startswith(("test", "validation")) for line in text.splitlines())
