"""Resolve once, pass down, in process: the resolved Job survives the pickling that a spawned rank
gets (what one 2-rank run builds per process is counted in tests/e2e/train/test_resolve_once.py).
"""

from __future__ import annotations

from tests.cli import ROOT

QUICKSTART = ROOT / "configs" / "criteo_quickstart.yaml"
TINY = [
    "data.num_rows=400",
    "train.max_steps=2",
    "train.log_every_n_steps=1",
    "train.progress_bar=false",
    "checkpoint.enabled=false",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[8]",
    "model.over_arch_layer_sizes=[8,1]",
    "distributed.nproc_per_node=2",
    "distributed.device=cpu",
]


def test_a_spawned_rank_gets_the_job_pickled():
    """``distributed.start_method: spawn`` pickles the Job to each rank: config, features and
    world travel; the format object and the model's registry entry are looked up again."""
    import pickle

    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.models.registry import GIVEN_MODEL

    job = resolve_job(load_config(QUICKSTART, TINY))
    back = pickle.loads(pickle.dumps(job))
    assert back.sections() == job.sections() and back.to_dict() == job.to_dict() and back.world == job.world
    assert back.features.keys == job.features.keys and back.features.id_bounds == job.features.id_bounds
    assert back.prepared is None
    tables = [(t.name, t.num_embeddings, t.embedding_dim) for t in back.features.planned_tables()]
    assert tables == [(t.name, t.num_embeddings, t.embedding_dim) for t in job.features.planned_tables()]
    assert back.model_spec is job.model_spec and list(back.fmt.sparse_names) == list(job.fmt.sparse_names)
    # Trainer(model=...): the given model travels as such (no hooks of model.name's on the rank)
    assert pickle.loads(pickle.dumps(job.given_model())).model_spec is GIVEN_MODEL
