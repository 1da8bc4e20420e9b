"""benchmarks/hstu_retrieval_compare.py through its command line on hand-made logs: each sequence
run read at its best validation epoch within the common budget (the last epoch every sequence
run reached), the two-tower run at its final line, and the paired differences' point values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_compare_reads_the_best_epoch_within_the_common_budget(tmp_path):
    def line(enc, seed, epoch, val, ranks):
        return json.dumps({"encoder": enc, "seed": seed, "epoch": epoch, "val_ndcg@10": val, "test_ranks": ranks})

    hstu = [line("hstu", 0, 10, 0.01, [50, 50]), line("hstu", 0, 20, 0.03, [1, 50]), line("hstu", 0, 30, 0.09, [1, 1])]
    # SASRec stopped at epoch 20: the budget is 20 for both, so HSTU's epoch 30 is not read
    sasrec = [line("sasrec", 0, 10, 0.02, [3, 50]), line("sasrec", 0, 20, 0.01, [50, 50])]
    tower = {"encoder": "two_tower", "seed": 0, "epoch": 4, "validation": {"ndcg@10": 0.5}, "test": {}}
    (tmp_path / "a.jsonl").write_text("\n".join(hstu + sasrec) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({**tower, "test_ranks": [11, 2]}) + "\nnot json\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "benchmarks/hstu_retrieval_compare.py",
        "--smoke",
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.jsonl"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "read at epochs <= 20" in out
    rows = {r.split("|")[1].strip(): r for r in out.splitlines() if r.startswith("| ")}
    assert "| 20 | 0.5000 (0.5000-0.5000) |" in rows["HSTU"]  # HR@10 of ranks [1, 50]
    assert "| 10 | 0.5000 (0.5000-0.5000) |" in rows["SASRec"]  # its best validation epoch: ranks [3, 50]
    # HSTU [1, 50] - SASRec [3, 50]: HR@10 0.5 - 0.5, NDCG@10 0.5 - 0.25, MRR 0.51 - 0.1767
    assert "| HSTU - SASRec | 0 | +0.0000 [" in rows["HSTU - SASRec"]
    assert "| +0.2500 [" in rows["HSTU - SASRec"] and "| +0.3333 [" in rows["HSTU - SASRec"]
    assert "| 4 |" in rows["two-tower"]  # read at its final line
    assert "| HSTU - two-tower | 0 | +0.0000 [" in rows["HSTU - two-tower"]  # [11, 2]: HR@10 0.5
