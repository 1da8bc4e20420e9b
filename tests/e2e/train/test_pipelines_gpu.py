"""train.pipeline semi_sync and fused_sparse_dist (CUDA only; refused on CPU, see
recsys_dist/train/pipelines.py): each trains, evaluates, checkpoints and resumes exactly.

Not run on the CPU development machine (no GPU there): written to the CPU resume test's
pattern (tests/e2e/checkpoint/test_resume.py), unverified until a CUDA machine runs it.
"""

import pytest

from recsys_dist.train.pipelines import PIPELINES
from tests.e2e.checkpoint.test_resume import assert_same_losses, train

GPU = ["distributed.nproc_per_node=1", "distributed.device=cuda", "train.batch_size=96"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pipeline", [n for n, p in PIPELINES.items() if p.cuda_only])
def test_cuda_pipeline_trains_and_resumes_exactly(tmp_path, pipeline):
    # semi_sync restarts its pipeline at every checkpoint (its early lookups would otherwise
    # differ after a resume), so the reference checkpoints at the same steps, and the first
    # part stops on one of them.
    ref = tmp_path / "ref"
    r = train(tmp_path, ref, *GPU, f"train.pipeline={pipeline}", "checkpoint.every_n_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "resumed"
    r = train(tmp_path, run, *GPU, f"train.pipeline={pipeline}", "train.max_steps=8", "checkpoint.every_n_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    r = train(tmp_path, run, "--resume", "auto", *GPU, f"train.pipeline={pipeline}", "checkpoint.every_n_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_losses(ref, run, 0.0)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cuda_dropout_resumes_to_the_uninterrupted_losses(tmp_path):
    """Dropout on CUDA draws from the device's generator, which the checkpoint holds too
    (recsys_dist.checkpoint.rng): a run stopped at step 8 and resumed logs the uninterrupted
    run's losses exactly."""
    dropout = [*GPU, "model.name=dcnv2", "model.dropout=0.3", "checkpoint.every_n_steps=8"]
    ref = tmp_path / "ref"
    r = train(tmp_path, ref, *dropout)
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "resumed"
    r = train(tmp_path, run, *dropout, "train.max_steps=8")
    assert r.returncode == 0, r.stderr[-2000:]
    r = train(tmp_path, run, "--resume", "auto", *dropout)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_losses(ref, run, 0.0)
