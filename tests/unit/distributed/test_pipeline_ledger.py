"""Issue 38 item 7: ``recsys-dist plan`` under ``distributed.dense.strategy: pipeline`` counts the
stages' collectives (their bytes computed here by hand from the quickstart's towers) and shows
the layout: the data x pipeline grid, which rank holds which stages, their parameters.
Before, the plan's ledger left them out (no bytes for the pipeline at all) and said only "cut
into stages, one per rank"."""

import pytest

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.dry_run import dry_run
from tests.conftest import QUICKSTART

B = 32  # the quickstart's train.batch_size: rows per rank per step
F = 4  # fp32


def _report(world: int, *overrides: str):
    cfg = load_config(
        QUICKSTART, ["data.num_embeddings=200", "distributed.dense.strategy=pipeline", *overrides], check_files=False
    )
    return dry_run(resolve_job(cfg, world_size=world), world, world, "cpu")


def _flows(led, phase: str, table: str) -> list[tuple[float, float]]:
    out = [[0.0, 0.0] for _ in range(led.world_size)]
    for f in led.flows:
        if f.phase == phase and f.table == table:
            out[f.rank][0] += f.sent
            out[f.rank][1] += f.received
    return [tuple(x) for x in out]


def test_interleaved_dlrm_on_two_pipelines_of_two_ranks():
    """dlrm's tower: the interaction ([B, 429] -> [B, 367], 1,936 parameters), two perceptrons
    (-> 64, 23,552; -> 32, 2,080) and the last linear (-> 1, 33): 2 ranks x 2 stages each, one
    module a stage; ranks 0, 2 hold stages 0 and 2, ranks 1, 3 stages 1 and 3; 2 microbatches."""
    rep = _report(4, "distributed.dense.stages=2", "distributed.dense.schedule=interleaved_1f1b")
    led = rep.ledger
    pooled = B * 429 * F  # one rank's pooled embeddings (and their gradient)
    labels = 1 * B * 2 * F  # the all_gather of (label, weight) rows: one chunk to the other rank
    weight = F  # the global batch weight's all-reduce over the 2 pipelines
    result = 2 * B * F  # the pipeline's logits, broadcast by the last stage's rank
    first = (labels + weight + pooled, labels + weight + pooled + result)  # gathers, scatters; gets the result
    last = (labels + weight + pooled + result, labels + weight + pooled)
    assert _flows(led, "pipeline_io", "pipeline") == [first, last, first, last]
    # stage k -> k + 1 over all 2 x 32 rows of the pipeline, forward and (the gradient) backward
    p2p = 2 * B * (367 + 64 + 32) * F  # every boundary joins rank 0 and rank 1 of the pipeline
    assert _flows(led, "pipeline_p2p", "pipeline") == [(p2p, p2p)] * 4
    even, odd = (1936 + 2080) * F, (23552 + 33) * F  # each rank's stages' gradients, over the 2 pipelines
    assert _flows(led, "allreduce", "dense") == [(even, even), (odd, odd), (even, even), (odd, odd)]
    rows = led.per_rank()
    for phase in ("pipeline_io", "pipeline_p2p"):  # every byte sent is received
        assert sum(r[phase]["sent"] for r in rows) == sum(r[phase]["received"] for r in rows)
    layout = rep.dense["pipeline"]
    assert layout["grid"] == {"dp": 2, "pp": 2} and layout["stages_per_rank"] == 2
    assert [(s["stage"], s["modules"], s["parameters"], s["output_width"], s["ranks"]) for s in layout["stages"]] == [
        (0, [0, 1], 1936, 367, [0, 2]),
        (1, [1, 2], 23552, 64, [1, 3]),
        (2, [2, 3], 2080, 32, [0, 2]),
        (3, [3, 4], 33, 1, [1, 3]),
    ]
    text = rep.text()
    assert "pipeline layout: 2 x 2 ranks (data x pipeline; pipeline 0: ranks 0-1; pipeline 1: ranks 2-3)" in text
    assert "4 stages, 2 per rank (pipeline rank i holds stages i, i + 2, ...), schedule interleaved_1f1b" in text
    assert "one per rank" not in text
    assert "pp p2p" in text and "pp io" in text


def test_gpipe_dcnv2_on_three_ranks():
    """dcnv2's six modules cut by hand at [2, 4] into 3 stages, one a rank, one pipeline (no
    data-parallel all-reduce); x0 is [B, 429], a cross layer carries [x0, x_l] (858 columns),
    the parallel deep layers [x_c, h] (429 + 256), the head 1. 6 microbatches: the same bytes."""
    rep = _report(
        3,
        "model.name=dcnv2",
        "distributed.dense.stages=3",
        "distributed.dense.schedule=gpipe",
        "distributed.dense.split=[2, 4]",
        "distributed.dense.microbatches=6",
    )
    led = rep.ledger
    assert [s["output_width"] for s in rep.dense["pipeline"]["stages"]] == [858, 429 + 256, 1]
    pooled, labels, result = B * 429 * F, 2 * B * 2 * F, 3 * B * F
    assert _flows(led, "pipeline_io", "pipeline") == [
        (labels + 2 * pooled, labels + 2 * pooled + result),  # rank 0: gathers 2 blocks, scatters 2
        (labels + pooled, labels + pooled + result),
        (labels + pooled + 2 * result, labels + pooled),  # rank 2 broadcasts to 2 ranks
    ]
    b01, b12 = 3 * B * 858 * F, 3 * B * 685 * F
    assert _flows(led, "pipeline_p2p", "pipeline") == [(b01, b01), (b01 + b12, b01 + b12), (b12, b12)]
    assert _flows(led, "allreduce", "dense") == [(0, 0)] * 3


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_other_strategies_have_no_pipeline_bytes_or_layout(strategy):
    cfg = load_config(QUICKSTART, ["data.num_embeddings=200", f"distributed.dense.strategy={strategy}"])
    rep = dry_run(resolve_job(cfg, world_size=2), 2, 2, "cpu")
    assert all(f.phase not in ("pipeline_io", "pipeline_p2p") for f in rep.ledger.flows)
    assert "pipeline" not in rep.dense and "pp io" not in rep.text()


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_a_stage_ranks_dense_bytes_are_its_stages(schedule):
    """A rank holds only its own stages' parameters, their gradients and their Adam state; 2bw
    also its stages' previous weights. (The plan showed the whole tower's parameters and
    optimizer state on every rank, which every rank then really held.) The real bytes after a
    step: tests/ranks/distributed/test_dense_pipeline.py."""
    ddp = _report(2, "distributed.dense.strategy=ddp").dense["per_rank"]
    rep = _report(2, "distributed.dense.stages=2", f"distributed.dense.schedule={schedule}")
    stages, tower = rep.dense["pipeline"]["stages"], ddp[0]["parameters"]
    assert tower == sum(s["parameters"] for s in stages) * F  # the quickstart has no dense weight outside the tower
    for rank, row in enumerate(rep.dense["per_rank"]):
        own = sum(s["parameters"] for s in stages if s["ranks"] == [rank]) * F
        assert 0 < own < tower
        assert row["gradients"] == own
        assert row["optimizer"] == own * ddp[rank]["optimizer"] // tower
        assert row["parameters"] == own * (2 if schedule == "2bw" else 1)
    assert "holds only its own stages" in rep.text()
