"""Issue 38 item 2 from the CLI: ``recsys-dist train ... distributed.dense.strategy=pipeline`` on the
quickstart (2 ranks, 2 stages; validation and checkpoints mid-epoch, keep_best) trains as ``ddp``
does, and validates to ddp's AUC (the scoring pass runs through the stages: each rank holds only
its own); ``recsys-dist export`` of its run is the same unsharded model as ddp's (the checkpoint
holds every stage, each written by its rank); and its mid-run checkpoint resumes under ``ddp``
to the same end."""

import pytest
from safetensors.torch import load_file

from tests.cli import read_metrics, run_cli, run_train
from tests.conftest import QUICKSTART

STEPS = [
    "train.max_steps=30",
    "train.log_every_n_steps=10",
    "eval.every_n_steps=10",
    "checkpoint.every_n_steps=10",
    "checkpoint.keep_best=true",
]
PIPELINE = ["distributed.dense.strategy=pipeline", "distributed.dense.stages=2"]


def _losses(run, split: str, key: str) -> list[float]:
    return [m[key] for m in read_metrics(run, split)]


def test_pipeline_run_export_and_resume_match_ddp(tmp_path):
    runs = {}
    for strategy, extra in (("ddp", []), ("pipeline", PIPELINE)):
        run = tmp_path / strategy
        r = run_train(QUICKSTART, run, *extra, *STEPS, tmp=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        out = tmp_path / f"{strategy}.export"
        e = run_cli(["export", str(run), "--out", str(out)], tmp_path)
        assert e.returncode == 0, e.stderr[-3000:]
        runs[strategy] = load_file(str(out / "model.safetensors"))
    pipe = tmp_path / "pipeline"
    # the run's ledger line counts the stages' collectives (issue 38 item 7): none under ddp
    ledgers = {s: read_metrics(tmp_path / s, "ledger")[0]["per_rank"] for s in runs}
    assert all(r["pipeline_p2p"]["sent"] > 0 and r["pipeline_io"]["sent"] > 0 for r in ledgers["pipeline"])
    assert all(r["pipeline_p2p"]["sent"] == r["pipeline_io"]["sent"] == 0 for r in ledgers["ddp"])
    losses = {s: _losses(tmp_path / s, "train", "loss") for s in runs}
    assert len(losses["ddp"]) == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses["pipeline"], losses["ddp"], strict=True)), losses
    val = {s: _losses(tmp_path / s, "validation", "auc") for s in runs}
    assert len(val["ddp"]) >= 3 and all(abs(a - b) < 1e-6 for a, b in zip(val["pipeline"], val["ddp"], strict=True))
    assert runs["pipeline"].keys() == runs["ddp"].keys()
    for k, v in runs["ddp"].items():
        assert (runs["pipeline"][k] - v).abs().max().item() < 1e-4, k
    # the pipeline run's step-20 checkpoint, resumed under ddp, ends where the pipeline run ended
    resumed = tmp_path / "resumed"
    r = run_train(QUICKSTART, resumed, *STEPS, "--resume", str(pipe / "checkpoints" / "step_00000020"), tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(resumed, "train")] == [30]  # resumed at 20, not trained from 0
    end = _losses(resumed, "train", "loss")[-1]
    assert abs(end - losses["pipeline"][-1]) <= 1e-5 * abs(end), (end, losses)
    assert abs(_losses(resumed, "validation", "auc")[-1] - val["pipeline"][-1]) < 1e-6


@pytest.mark.slow
@pytest.mark.timeout(900)  # three runs, one of 4 ranks
def test_data_by_pipeline_at_four_ranks_resumes_under_ddp_at_two(tmp_path):
    """2 pipelines of 2 stages (4 ranks, 16 rows each) train ddp's 2 ranks of 32 rows (the same
    global batch); their step-20 checkpoint resumes under ddp at 2 ranks to ddp's step 30."""
    common = ["train.log_every_n_steps=10", "checkpoint.every_n_steps=10"]
    ddp, pipe, resumed = tmp_path / "ddp", tmp_path / "pipe", tmp_path / "resumed"
    runs = [
        (ddp, ["train.max_steps=30"]),
        (pipe, ["train.max_steps=20", "distributed.nproc_per_node=4", "train.batch_size=16", *PIPELINE]),
        (resumed, ["train.max_steps=30", "--resume", str(pipe / "checkpoints" / "step_00000020")]),
    ]
    for run, extra in runs:
        r = run_train(QUICKSTART, run, *common, *extra, tmp=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    want = _losses(ddp, "train", "loss")
    assert len(want) == 3
    got = _losses(pipe, "train", "loss") + _losses(resumed, "train", "loss")
    assert [m["step"] for m in read_metrics(resumed, "train")] == [30]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want, strict=True)), (got, want)


def test_a_killed_2bw_run_resumes_with_the_same_losses(tmp_path):
    """schedule 2bw from the CLI: rank 1 SIGKILLed at step 15 (no restarts), ``--resume auto``
    from the step-10 checkpoint (which holds each stage's W(t-1) besides the weights: without it
    step 11 would run on W(10), not W(9)) ends with the uninterrupted run's train and validation
    lines."""
    steps = ["train.max_steps=20", "train.log_every_n_steps=5", "eval.every_n_steps=10", "checkpoint.every_n_steps=10"]
    two_bw = [*PIPELINE, "distributed.dense.schedule=2bw", *steps]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    r = run_train(QUICKSTART, whole, *two_bw, tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(QUICKSTART, killed, *two_bw, tmp=tmp_path, env={"RECSYS_DIST_FAULT": "step:15:1"})
    assert r.returncode == 1 and "rank 1 was killed by SIGKILL" in r.stderr, r.stderr[-3000:]
    r = run_train(QUICKSTART, killed, *two_bw, "--resume", "auto", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = _losses(whole, "train", "loss"), _losses(killed, "train", "loss")
    assert len(want) == 4 and [m["step"] for m in read_metrics(killed, "train")][-2:] == [15, 20], got
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got[-2:], want[-2:], strict=True)), (got, want)
    assert _losses(killed, "validation", "auc")[-1] == _losses(whole, "validation", "auc")[-1]
