"""Resume and resharding checks that need several trainings each (split from
test_checkpoint.py so that the two files run on different test workers)."""

import json

import pytest

from tests.e2e.checkpoint.test_resume import BASE, WS, assert_same_losses, train


@pytest.mark.slow
def test_resharded_state_arrives_exactly(tmp_path):
    """Weights and row-wise Adagrad accumulators saved from 2 ranks table-wise, loaded into
    3 ranks row-wise and 1 rank data-parallel, equal the saved tensors bit for bit."""
    import torch
    import torch.distributed.checkpoint as dcp

    from recsys_dist.testing import run_ranks
    from tests.ranks.checkpoint.reshard_worker import resharded_state

    run = tmp_path / "run"
    r = train(tmp_path, run, *WS[2], "sharding.sharding_types=[table_wise]", "train.max_steps=6")
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = run / "checkpoints" / "step_00000006"
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    saved = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in meta.items() if hasattr(m, "size")}
    dcp.load(saved, checkpoint_id=str(ckpt), no_dist=True)
    # each rank's own random stream (its dropout masks), not one rank's for all
    assert {k for k in saved if k.startswith("rng")} == {"rng.rank_0", "rng.rank_1"}
    momentum = [k for k in saved if k.startswith("optimizer.") and k.endswith("t_C1.weight.momentum1")]
    assert momentum and saved[momentum[0]].abs().sum() > 0  # the accumulators were really trained
    for ws, st in ((3, "row_wise"), (1, "data_parallel")):
        overrides = [*BASE, *WS[ws], f"sharding.sharding_types=[{st}]"]
        (full, types), *others = run_ranks(resharded_state, ws, overrides, str(ckpt), str(tmp_path / "cache"))
        assert types == [st]
        assert sorted(full) == sorted(k for k in saved if not k.startswith("rng")), set(full) ^ set(saved)
        for key, tensor in full.items():
            assert torch.equal(tensor, saved[key].reshape(tensor.shape)), key


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_resume_is_exact_with_a_lazy_dense_optimizer(tmp_path, optimizer):
    """Adam makes its moments at its first step: a resumed run must load them, not restart them."""
    opt = [f"train.dense_optimizer={optimizer}", "train.dense_lr=0.001"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(tmp_path, ref, *WS[1], *opt).returncode == 0
    r = train(tmp_path, run, *WS[1], *opt, "train.max_steps=10")
    assert r.returncode == 0, r.stderr[-2000:]
    r = train(tmp_path, run, "--resume", "auto", *WS[1], *opt)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_losses(ref, run, 0.0)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # four 2-rank runs (12 minutes on a loaded 2-core machine)
def test_base_pipeline_matches_sparse_dist_and_resumes_exactly(tmp_path):
    # train.pipeline=base (TrainPipelineBase) computes what sparse_dist does (both synchronous),
    # and resumes exactly like it.
    base = [*WS[2], "sharding.sharding_types=[table_wise]", "train.pipeline=base", "train.timing_every_n_steps=2"]
    ref, sd = tmp_path / "ref", tmp_path / "sd"
    assert train(tmp_path, ref, *base).returncode == 0
    # base has the stage timer too (its forward holds input_dist)
    lines = [json.loads(ln) for ln in (ref / "metrics.jsonl").read_text().splitlines()]
    timed = [ln for ln in lines if ln.get("split") == "train" and "time_forward_ms" in ln]
    assert timed, "no stage times on base's train lines"
    assert {"time_data_ms", "time_forward_ms", "time_backward_ms", "time_optimizer_ms"} <= set(timed[0])
    assert "time_input_dist_ms" not in timed[0] and all(ln["time_forward_ms"] > 0 for ln in timed)
    assert train(tmp_path, sd, *WS[2], "sharding.sharding_types=[table_wise]").returncode == 0
    assert_same_losses(ref, sd, 0.0)
    run = tmp_path / "resumed"
    r = train(tmp_path, run, *base, "train.max_steps=10", "checkpoint.every_n_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    r = train(tmp_path, run, "--resume", "auto", *base)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_losses(ref, run, 0.0)
