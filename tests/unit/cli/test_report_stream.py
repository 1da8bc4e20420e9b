"""``recsys-dist report`` / ``compare`` of data.stream runs: one real run (2 partitions and a
quarantined one, 1 rank) and synthetic metrics.jsonl files (many partitions, managed tables, a
run without summary.json)."""

import json

from recsys_dist.cli import report as rpt

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
