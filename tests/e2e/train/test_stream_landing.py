"""data.stream landing and restarts, one rank in this process: a file is taken once it has
stopped changing; a trained file that changes is warned about, a quarantined one retried;
bad rows skipped are counted; quarantines and empty partitions after the last step survive a
resume; a SIGTERM inside a logging window leaves the lines of an uninterrupted run."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import recsys_dist
from recsys_dist.train import stream as train_stream
from recsys_dist.train.summary import print_summary
from tests.cli import read_metrics
from tests.unit.train.test_stream import BAD, CONFIG, NAMES, ROWS, SAMPLE, TIMING, land, overrides
from tests.unit.train.test_stream_landing import ONE_RANK


def run(landing: Path, run_dir: Path, *extra: str, resume=None, callbacks=()) -> dict:
    cfg = recsys_dist.load_config(CONFIG, [*overrides(landing), *ONE_RANK, *extra])
    with recsys_dist.StreamTrainer(cfg, run_dir, resume=resume, callbacks=list(callbacks)) as trainer:
        return trainer.fit()


def lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def logged():
    """The messages of the ``recsys_dist`` logger (which does not propagate once a Trainer set it up)."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("recsys_dist")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


@pytest.mark.slow
def test_a_partition_written_in_place_is_taken_whole(tmp_path):
    """The issue's case: a file written in place (no rename) was trained half-read, exit 0, the
    rest never read. Written in 10 pieces 0.05 s apart, it is taken once it has not changed for
    data.stream.min_file_age_seconds: every row, once."""
    landing, run_dir = tmp_path / "landing", tmp_path / "run"
    land(landing, NAMES[0])
    lines_ = SAMPLE.read_bytes().splitlines(keepends=True)[ROWS : 2 * ROWS]
    target = landing / NAMES[1]
    target.parent.mkdir(parents=True)

    class WriteInPlace(recsys_dist.Callback):
        def on_partition_end(self, trainer, partition, checkpoint):
            if partition != NAMES[0]:
                return

            def write():
                with open(target, "wb") as f:
                    for k in range(10):
                        f.write(b"".join(lines_[k * 64 : (k + 1) * 64]))
                        f.flush()
                        time.sleep(0.05)

            threading.Thread(target=write, daemon=True).start()
            time.sleep(0.02)  # it has begun when the run looks again

    summary = run(landing, run_dir, "data.stream.min_file_age_seconds=1", callbacks=[WriteInPlace()])
    assert summary["partitions"] == NAMES[:2] and summary["quarantined"] == {}, summary
    assert [p["rows"] for p in read_metrics(run_dir, "partition")] == [ROWS, ROWS]
    assert summary["rows_trained"] == 2 * ROWS


@pytest.mark.slow
def test_quarantines_and_empties_after_the_last_step_survive_and_changed_files_are_seen(tmp_path, logged, monkeypatch):
    """A quarantine and an empty partition after the last training step were not in any
    checkpoint: a resume read them again. Now kept beside the checkpoint of that step. Then: a
    trained file that changes is warned about by name, once a run; a quarantined one that
    changes is tried again (it stayed quarantined for good)."""
    landing, run_dir = tmp_path / "landing", tmp_path / "run"
    for name in (NAMES[0], BAD):
        land(landing, name)
    empty = "day=0/hour=01/part-2.txt"
    (landing / empty).write_bytes(b"")
    first = run(landing, run_dir)
    assert first["partitions"] == [NAMES[0], empty] and list(first["quarantined"]) == [BAD]
    before = lines(run_dir)
    assert [(r["split"], r.get("partition"), r["step"]) for r in before if "partition" in r] == [
        ("validation", NAMES[0], 0),
        ("partition", NAMES[0], 10),
        ("quarantine", BAD, 10),
        ("partition", empty, 10),
    ]
    converted = []
    real = train_stream.convert_partition
    monkeypatch.setattr(
        train_stream,
        "convert_partition",
        lambda d, name, cache, *carried: converted.append(name) or real(d, name, cache, *carried),
    )
    second = run(landing, run_dir, resume="auto")
    assert converted == [] and lines(run_dir) == before  # nothing read again, nothing written twice
    assert second["partitions"] == first["partitions"] and second["quarantined"] == first["quarantined"]
    # The trained file grows; the quarantined one is landed again, whole.
    with open(landing / NAMES[0], "ab") as f:
        f.write(SAMPLE.read_bytes().splitlines(keepends=True)[9000])
    (landing / BAD).write_bytes(b"".join(SAMPLE.read_bytes().splitlines(keepends=True)[5000:5064]))
    logged.clear()
    third = run(landing, run_dir, "data.stream.stop_after_idle_seconds=1", resume="auto")
    changed = [m for m in logged if "changed after it was trained" in m]
    assert len(changed) == 1 and changed[0].startswith(f"data.stream: partition {NAMES[0]} changed after it")
    assert third["partitions"] == [NAMES[0], empty, BAD] and third["quarantined"] == {}, third
    assert converted == [BAD] and third["rows_trained"] == ROWS + 64
    (bad,) = read_metrics(run_dir, "quarantine")  # its first quarantine stays on record
    assert bad["partition"] == BAD and bad["step"] == 10


@pytest.mark.slow
def test_rows_skipped_in_a_stream_are_counted_and_kept(tmp_path, logged, capsys):
    """on_bad_row: skip in a stream left out rows and counted nothing: now in the partition
    line, summary.json and the checkpoint (so a resumed run's summary still has them), and the
    log names the first bad line."""
    landing, run_dir = tmp_path / "landing", tmp_path / "run"
    for name in (NAMES[0], BAD):
        land(landing, name)
    summary = run(landing, run_dir, "data.on_bad_row=skip")
    assert summary["partitions"] == [NAMES[0], BAD] and summary["quarantined"] == {}
    assert summary["rows_skipped"] == 1 and summary["skipped"] == {BAD: 1} and summary["rows_trained"] == ROWS + 9
    parts = read_metrics(run_dir, "partition")
    assert [(p["partition"], p["rows"], p["skipped"]) for p in parts] == [(NAMES[0], ROWS, 0), (BAD, 9, 1)]
    assert any(
        m.startswith(f"data.stream: partition {BAD}: 1 bad row(s) skipped")
        and m.endswith("the first: line 3: 12 fields, expected 40")
        for m in logged
    ), logged
    meta = json.loads((run_dir / "checkpoints" / "step_00000011" / "meta.json").read_text())
    assert meta["stream"]["skipped"] == {BAD: 1}
    resumed = run(landing, run_dir, "data.on_bad_row=skip", resume="auto")
    assert resumed["rows_skipped"] == 1 and resumed["skipped"] == {BAD: 1}
    print_summary(resumed)
    assert (
        "2 trained (day=0/hour=00/part-0.txt .. day=0/hour=01/part-1.txt), 1 bad row(s) skipped"
        in capsys.readouterr().out
    )


class SigtermAt(recsys_dist.Callback):
    """SIGTERM to this process after step ``step`` (the run stops at the next multiple of 8)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step, loss):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_inside_a_logging_window_leaves_the_uninterrupted_lines(tmp_path):
    """A SIGTERM stop at step 8 wrote a train line there (its window cut at 8) and the resumed
    run's next line averaged the rest of it: one line more, one loss another than an
    uninterrupted run's. The open window now travels in the checkpoint. (The multi-rank test in
    test_stream.py signals while the run waits between partitions, where no window is open.)"""
    landing = tmp_path / "landing"
    for name in NAMES[:2]:
        land(landing, name)
    args = ("checkpoint.every_n_steps=5",)  # lines at 3, 5 (a checkpoint), 6, 9, 10 (the end), ...
    reference = run(landing, tmp_path / "ref", *args)
    stopped = run(landing, tmp_path / "run", *args, callbacks=[SigtermAt(6)])
    assert stopped["stopped"] == "SIGTERM" and stopped["steps"] == 8 and stopped["rows_trained"] == 8 * 64
    assert [r["step"] for r in read_metrics(tmp_path / "run", "train")] == [3, 5, 6]  # steps 7, 8: still open
    resumed = run(landing, tmp_path / "run", *args, resume="auto")
    assert lines(tmp_path / "run") == lines(tmp_path / "ref")
    assert resumed["rows_trained"] == reference["rows_trained"] == 2 * ROWS
