"""Resume and resharding checks that need several trainings each (split from
test_checkpoint.py so that the two files run on different test workers)."""

import json

import pytest

from tests.conftest import QUICKSTART


def test_a_checkpoint_of_recsys_dist_0_1_is_refused_not_remapped(tmp_path):
    """recsys_dist 0.1.0 wrote checkpoints of format 1: DeepFM's first-order tables in a
    collection of their own (``model.first_order``), one ``rng`` state for every rank, no
    ``checksums.json`` and no ``checkpoint_format`` in ``meta.json``. They were once re-keyed
    and loaded; now every reader refuses one (load, export / evaluate, resume), naming the
    checkpoint, the format found and expected and what to do, and changes nothing."""
    import torch
    import torch.distributed.checkpoint as dcp

    from recsys_dist.checkpoint.dcp import load_checkpoint
    from recsys_dist.checkpoint.run_dir import resolve_resume
    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.errors import CheckpointError
    from recsys_dist.models.build import build_model
    from recsys_dist.serve.export import load

    cfg = load_config(QUICKSTART, ["model.name=deepfm", "data.num_embeddings=50"])
    job = resolve_job(cfg)
    cpu = torch.device("cpu")
    features = job.features.on(cpu)
    torch.manual_seed(0)
    saved = build_model(job.model, features, job.train).state_dict()
    old = {k.replace(".sparse_arch.embedding_bags.w_", ".first_order.embedding_bags.w_"): v for k, v in saved.items()}
    assert sum(".first_order." in k for k in old) == 26
    ckpt = tmp_path / "step_00000003"
    dcp.save({"model": old, "rng": torch.get_rng_state()}, checkpoint_id=ckpt, no_dist=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "world_size": 1, "config": cfg.to_dict()}))

    torch.manual_seed(1)
    model = build_model(job.model, features, job.train)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = (
        f"checkpoint {ckpt} was written by an older recsys_dist (checkpoint format 1; this one reads format 2 "
        "only): retrain, or use recsys_dist 0.1.0 to evaluate or export it"
    )
    for read in (
        lambda: load_checkpoint(ckpt, {"model": model.state_dict(), "rng": {"rank_0": torch.get_rng_state()}}),
        lambda: load(ckpt),
        lambda: resolve_resume(str(ckpt), tmp_path),
    ):
        with pytest.raises(CheckpointError) as e:
            read()
        assert str(e.value) == want
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
