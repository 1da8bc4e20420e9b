"""Issue 38 item 2: ``distributed.dense.strategy: pipeline`` (the dense tower after the pooled
embeddings as torch.distributed.pipelining stages, one per rank; the tables sharded by TorchRec
over every rank) trains as ``ddp`` does, and its checkpoints move both ways between the two.

Each case trains through the trainer's sharding path and the Trainer's pipeline step from one
seed on the same per-rank batches (one step with the last rank's batch all padding), plain SGD
on tables and tower (so that a gradient off by a factor shows; pipeline_worker.SGD says why not
Adam). Global losses must agree to 1e-5 relative at every one of 50 steps, the tables' weights
after them to 1e-5 absolute, each dense tensor to 1e-3 of its update over the steps (in norm).
Measured: docs/sharding.md (the dense tower as pipeline stages).
"""

import pytest
import torch

from recsys_dist.distributed.dense import planned_dense_bytes
from recsys_dist.models.build import build_model
from recsys_dist.testing import run_ranks
from recsys_dist.train.dry_run import dry_run
from tests.ranks.distributed import pipeline_worker

TOL = 1e-5
TWO_RANKS = [
    ("dcnv2", ["row_wise"], ("distributed.dense.schedule=gpipe",)),
    ("dlrm", ["table_wise"], ("distributed.dense.schedule=1f1b", "distributed.dense.microbatches=4")),
    # replicated tables: their gradients averaged beside the stages; an explicit cut
    ("dcnv2", ["data_parallel"], ("distributed.dense.microbatches=8", "distributed.dense.split=[3]")),
    # several stages per rank (issue 38): 2 ranks x 2 stages (the default), torch's loop placement
    ("dcnv2", ["row_wise"], ("distributed.dense.schedule=interleaved_1f1b", "distributed.dense.microbatches=4")),
    # zero bubble, 3 stages per rank (the 6 modules of dcnv2's tower, one a stage), 8 microbatches in 4 rounds
    (
        "dcnv2",
        ["table_wise"],
        (
            "distributed.dense.schedule=zero_bubble",
            "distributed.dense.stages_per_rank=3",
            "distributed.dense.microbatches=8",
        ),
    ),
    # fewer microbatches than ranks x stages per rank (one round), an explicit cut into 4
    ("dlrm", ["data_parallel"], ("distributed.dense.schedule=zero_bubble", "distributed.dense.split=[1, 2, 3]")),
]
THREE_RANKS = [
    ("dcnv2", ["row_wise"], ("distributed.dense.schedule=1f1b", "distributed.dense.microbatches=6")),
    ("dlrm", ["row_wise", "table_wise"], ("distributed.dense.schedule=gpipe",)),
]


def _stages_per_rank(case) -> int:
    extra = " ".join(case[2])
    if "stages_per_rank=" in extra:
        return int(extra.split("stages_per_rank=")[1].split()[0])
    return 2 if "interleaved" in extra or "zero_bubble" in extra else 1


def _check(results: list[dict], stages: int) -> None:
    failures = []
    for rank, per_case in enumerate(results):
        for case, got in per_case.items():
            ddp, pipe = got["ddp"], got["pipeline"]
            assert len(pipe) == 50 and len(set(pipe)) > 40, case  # it trains
            rel = max(abs(a - b) / abs(b) for a, b in zip(pipe, ddp, strict=True))
            if not rel <= TOL:
                failures.append(f"rank {rank} {case}: loss rel diff {rel:.3g}")
            # this rank's own loss (on_step_end's): ddp's. Before, the pipeline's loss, the mean of
            # its ranks' (the padding rank's step read 1/S of the others' instead of 0)
            own = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got["pipeline_own"], got["ddp_own"], strict=True))
            if not own <= TOL:
                failures.append(f"rank {rank} {case}: this rank's loss (on_step_end's) rel diff {own:.3g}")
            if not got["table_diff"] <= TOL:
                failures.append(f"rank {rank} {case}: table weights differ by {got['table_diff']:.3g}")
            if not got["score_diff"] <= 1e-4:  # logits of order 1: float rounding over 50 steps
                failures.append(f"rank {rank} {case}: scoring logits differ by {got['score_diff']:.3g}")
            if not got["dense_rel"] <= 1e-3:
                failures.append(f"rank {rank} {case}: dense weights differ by {got['dense_rel']:.3g} of their update")
            per_rank = _stages_per_rank(case)
            assert len(got["starts"]) == stages * per_rank and got["own_params"] > 0, (case, got["starts"])
            # loop placement: pipeline rank i holds stages i, i + S, ...
            assert got["owned"] == [rank % stages + k * stages for k in range(per_rank)], (case, got["owned"])
    for case in results[0]:
        assert len({tuple(r[case]["starts"]) for r in results}) == 1  # one cut on every rank
        # each rank holds only its own stages' dense weights; together, the pipeline holds the model's
        held = [set(r[case]["dense_keys"]) for r in results[:stages]]
        assert set().union(*held) == set(results[0][case]["ddp_dense_keys"]), case
        assert all(not (a & b) for i, a in enumerate(held) for b in held[i + 1 :]), case
        if "split=[3]" in str(case):
            assert results[0][case]["starts"] == [0, 3]  # auto cuts it at 2
    assert not failures, "\n".join(failures)


def test_pipeline_equals_ddp_at_two_ranks():
    _check(run_ranks(pipeline_worker.losses_and_weights, 2, TWO_RANKS, 50, timeout_s=600), 2)


def test_pipeline_equals_ddp_at_three_ranks():
    _check(run_ranks(pipeline_worker.losses_and_weights, 3, THREE_RANKS, 50, timeout_s=600), 3)


# data x pipeline: 2 pipelines of 2 stages (the padding step's rank is stage 1 of pipeline 1)
DATA_BY_PIPELINE = [
    ("dcnv2", ["row_wise"], ("distributed.dense.stages=2", "distributed.dense.microbatches=4")),
    ("dlrm", ["data_parallel"], ("distributed.dense.stages=2", "distributed.dense.schedule=gpipe")),
    # 2 stages per rank in each pipeline: stages 0, 2 on ranks 0 and 2, stages 1, 3 on ranks 1 and 3
    ("dcnv2", ["row_wise"], ("distributed.dense.stages=2", "distributed.dense.schedule=zero_bubble")),
]


@pytest.mark.slow
def test_two_pipelines_of_two_stages_equal_ddp_at_four_ranks():
    results = run_ranks(pipeline_worker.losses_and_weights, 4, DATA_BY_PIPELINE, 50, timeout_s=900)
    _check(results, 2)
    for case in results[0]:  # ranks 0 and 2 run stage 0, 1 and 3 stage 1
        own = [r[case]["own_params"] for r in results]
        assert own[0] == own[2] and own[1] == own[3] and own[0] != own[1], own


# the pipeline side of each checkpoint test, in one spawn: one stage per rank, and 2 per rank
# (a checkpoint of stages 0..3 on 2 ranks, or loaded into them)
RESUME_SCHEDULES = [(), ("distributed.dense.schedule=interleaved_1f1b", "distributed.dense.microbatches=4")]


@pytest.mark.parametrize(("first", "then"), [("ddp", "pipeline"), ("pipeline", "ddp")])
def test_checkpoint_resumes_under_the_other_strategy(tmp_path, first, then):
    results = run_ranks(
        pipeline_worker.resume_across, 2, str(tmp_path), first, then, 4, RESUME_SCHEDULES, timeout_s=600
    )
    for per_schedule in results:
        assert len(per_schedule) == len(RESUME_SCHEDULES)
        for extra, r in zip(RESUME_SCHEDULES, per_schedule, strict=True):
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["got"], r["want"], strict=True))
            assert rel <= TOL, (extra, r)  # the same weights and Adam state (to the strategies' float rounding)
            assert all(abs(a - b) > 1e-4 for a, b in zip(r["fresh"], r["want"])), (extra, r)  # the load did it


def test_a_pipeline_input_using_a_tower_parameter_is_refused_on_every_rank():
    """A tower parameter used in pipeline_input got its input-path gradient unaveraged on every
    rank's copy (wrong numbers, exit 0); now its first step raises on every rank, naming it."""
    for got in run_ranks(pipeline_worker.input_uses_the_tower, 2, timeout_s=600):
        assert isinstance(got["Tower"], list) and len(got["Tower"]) == 2, got  # the same model without it trains
        assert got["InputUsesTower"].startswith(
            "distributed.dense.strategy: pipeline: the model's pipeline_input uses parameters of its tower (l2.weight)"
        ), got


# issue 38 item 7: the ledger's pipeline bytes (recsys_dist.distributed.pipeline_traffic) against
# those counted at the collectives and torch's send / recv, of one step after the first
COUNTED = [
    ("dlrm", ("distributed.dense.stages=2", "distributed.dense.schedule=zero_bubble")),
    (
        "dlrm",
        (
            "distributed.dense.stages=2",
            "distributed.dense.schedule=interleaved_1f1b",
            "distributed.dense.microbatches=4",
        ),
    ),
    ("dcnv2", ("distributed.dense.stages=4", "distributed.dense.schedule=gpipe", "distributed.dense.microbatches=8")),
    ("dcnv2", ("distributed.dense.stages=2", "distributed.dense.schedule=2bw", "distributed.dense.microbatches=2")),
]


def test_the_ledgers_pipeline_bytes_are_the_counted_ones_at_four_ranks():
    results = run_ranks(pipeline_worker.counted_bytes, 4, COUNTED, timeout_s=600)
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(COUNTED)
        for case, got in per_case.items():
            assert got["counted"] == got["predicted"], (rank, case, got)
            assert got["counted"]["pipeline_io"][0] > 0 and got["counted"]["pipeline_p2p"][0] > 0, (rank, case)
            if "stages=2" in case[1][0]:  # 2 pipelines: each stage's gradients all-reduced over them
                assert got["counted"]["allreduce"][0] > 0, (rank, case)
    # the plan's per-rank dense bytes are what each rank holds after a step: its own stages'
    # parameters (2bw: twice), gradients and Adam state (two per element); every rank held
    # the whole tower's parameters and state before
    for case in COUNTED:
        job = pipeline_worker._cfg(case[0], ["table_wise"], "pipeline", 4, case[1])
        planned = dry_run(job, 4, 4, "cpu").dense["per_rank"]
        held = [r[case]["held"] for r in results]
        assert held == planned, (case, held, planned)
        whole = planned_dense_bytes(
            build_model(job.model, job.features.on(torch.device("meta")), job.train), "ddp", 4, "adam"
        )
        stages = int(case[1][0].split("=")[1])
        assert sum(h["gradients"] for h in held) == whole[0]["parameters"] * 4 // stages, (case, held)
