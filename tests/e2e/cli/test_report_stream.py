"""``recsys-dist report`` / ``compare`` of data.stream runs: one real run (2 partitions and a
quarantined one, 1 rank) and synthetic metrics.jsonl files (many partitions, managed tables, a
run without summary.json)."""

import pytest

from recsys_dist.cli import main as cli
from recsys_dist.cli import report as rpt
from tests.cli import read_metrics, run_train
from tests.unit.cli.test_report_stream import PNG_MAGIC, table_rows, write_stream
from tests.unit.train.test_stream import BAD, CONFIG, NAMES, ROWS, land, overrides


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
