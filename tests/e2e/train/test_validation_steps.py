"""Issue 21 items 2 and 3: each validation step is scored and logged once, and a run resumed
from the checkpoint of an epoch's last step keeps that epoch's validation.

One rank, 800 training rows, global batch 96: 9 steps per epoch, 2 epochs.
"""

import json

import pytest

from tests.cli import run_train
from tests.conftest import QUICKSTART

BASE = [
    "data.num_rows=1000",
    "data.num_embeddings=1000",
    "distributed.nproc_per_node=1",
    "train.batch_size=96",
    "train.epochs=2",
    "train.log_every_n_steps=2",
    "train.progress_bar=false",
    "train.deterministic=true",
    "train.timing_every_n_steps=null",
    "eval.every_n_steps=9",  # every epoch ends on a multiple of it
    "checkpoint.every_n_steps=3",
    "checkpoint.keep=10",
]
TIMINGS = {"samples_per_s"}


def lines(run_dir):
    out = []
    for ln in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(ln)
        if m["split"] == "ledger":  # written once per (re)start by design (recsys_dist.distributed.ledger)
            continue
        out.append({k: v for k, v in m.items() if k not in TIMINGS})
    return out


def train(tmp_path, run_dir, *extra, env=None):
    return run_train(QUICKSTART, run_dir, *BASE, *extra, tmp=tmp_path, env=env)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_validation_once_per_step_and_kept_across_a_resume(tmp_path):
    ref = tmp_path / "ref"
    r = train(tmp_path, ref)
    assert r.returncode == 0, r.stderr[-2000:]
    want = lines(ref)
    # Steps 9 and 18 end an epoch and are multiples of eval.every_n_steps: scored once each.
    assert [m["step"] for m in want if m["split"] == "validation"] == [9, 18]
    meta = json.loads((ref / "checkpoints" / "step_00000009" / "meta.json").read_text())
    assert meta["batches_in_epoch"] == 9  # the epoch's last step: a resume starts the next epoch

    # Killed while the validation of step 9 (the first epoch's end) runs. The checkpoint of
    # step 9 must not exist yet (else the resumed run would start epoch 1 and never log that
    # validation): the resume continues from step 6 and leaves the uninterrupted run's lines.
    run = tmp_path / "killed"
    r = train(tmp_path, run, env={"RECSYS_DIST_FAULT": "eval:9:0"})
    assert r.returncode != 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    r = train(tmp_path, run, "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert lines(run) == want
