"""Resolve once, pass down: what one 2-rank ``recsys-dist train`` builds and checks, per process.

The command runs in a ``python -c`` wrapper that first replaces the counted functions with
ones that append a line ``{"pid", "rank", "what"}`` to a file on every call (a line per call,
because the ranks leave through ``os._exit``, which skips ``atexit``). The ranks fork from the
wrapper (``recsys-dist``'s CPU start method), so they run the counting functions too.

Counted: RunConfig validation, preflight (``check_before_launch``) and its cross-section
pass (``section_problems``), model builds (the registered model's ``build``), ``feature_spec``
calls, and the planning path. Before the Job the launcher validated the YAML and
each rank validated it again (3 in all), ``section_problems`` ran 6 times and the model was
built on meta 5 times.
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

    from recsys_dist.config.loader import load_config
    from recsys_dist.train.job import resolve_job

    job = resolve_job(load_config(QUICKSTART, TINY))
    back = pickle.loads(pickle.dumps(job))
    assert back.cfg == job.cfg and back.world == job.world
    tables = [(t.name, t.num_embeddings, t.embedding_dim) for t in back.features.planned_tables()]
    assert tables == [(t.name, t.num_embeddings, t.embedding_dim) for t in job.features.planned_tables()]
    assert back.model is job.model and list(back.fmt.sparse_names) == list(job.fmt.sparse_names)
