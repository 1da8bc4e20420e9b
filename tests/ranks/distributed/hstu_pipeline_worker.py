"""HSTU (configs/movielens_hstu.yaml) under ``distributed.dense.strategy: pipeline`` against
``ddp``: one rank's side (run via run_ranks), as ``pipeline_worker.losses_and_weights`` does for
the Criteo models: the same seed, the same per-rank batches (histories of 0-12 events, padded
to the history's max_length 12 by the stages; at ``PADDED_STEP`` the last rank's batch is
padding only: every history empty, weights 0), plain SGD; the global loss of every step and
every weight after them."""

from __future__ import annotations

import torch
from torchrec import JaggedTensor, KeyedJaggedTensor

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.distributed.env import init_distributed
from tests.conftest import ROOT
from tests.ranks.distributed import dense_worker, pipeline_worker
from tests.ranks.models.hstu_worker import B, movielens_batch

CONFIG = ROOT / "configs" / "movielens_hstu.yaml"
PADDED_STEP = 3
COMMON = [
    "data.categorical_mapping=hash",
    "data.num_embeddings=200",
    "data.schema.history.max_length=12",
    "model.embedding_init_scale=0.5",
    "model.layer_dropout=0.0",
    f"train.batch_size={B}",
    "distributed.cpu_threads_per_rank=1",
    *pipeline_worker.SGD,
]


def _job(strategy: str, world_size: int, extra: tuple):
    pipe = ["distributed.dense.stages=2", *extra] if strategy == "pipeline" else []
    model = [e for e in extra if not e.startswith("distributed.")]  # the model's and data's keys: both sides
    overrides = [*COMMON, f"distributed.nproc_per_node={world_size}", f"distributed.dense.strategy={strategy}"]
    return resolve_job(load_config(str(CONFIG), [*overrides, *model, *(e for e in pipe if e not in model)]))


def _batch(step: int, rank: int, world_size: int, keys: list[str]):
    batch = movielens_batch(step * world_size + rank, 1, keys)
    if step == PADDED_STEP and rank == world_size - 1:  # the loader's padding: every list empty, weight 0
        jts = batch.sparse_features.to_dict()
        for k, jt in jts.items():
            if k.startswith("history"):
                jts[k] = JaggedTensor(values=jt.values()[:0], lengths=torch.zeros(B, dtype=torch.int64))
        batch = type(batch)(batch.dense_features, KeyedJaggedTensor.from_jt_dict(jts), batch.labels, torch.zeros(B))
    total = B * (world_size - (1 if step == PADDED_STEP else 0))
    batch.loss_scale = torch.tensor(float(batch.weights.sum()) * world_size / total)
    return batch


def losses_and_weights(rank: int, world_size: int, cases: list[tuple], steps: int) -> dict:
    """Per case (overrides of both sides: the pipeline's keys apply to its side only): ddp's and
    pipeline's global losses, the largest table difference, each dense tensor's difference over
    its update (norms), the pipeline's stage starts and this rank's stage's modules."""
    out = {}
    for extra in cases:
        got = {}
        for strategy in ("ddp", "pipeline"):
            job = _job(strategy, world_size, extra)
            ctx = init_distributed(job.distributed)
            dmp, opt = dense_worker._build(job, ctx)
            first = pipeline_worker._weights(dmp)
            keys = list(job.features.keys)
            batches = (_batch(step, rank, world_size, keys) for step in range(steps))
            losses = pipeline_worker.train_on(dmp, opt, batches, world_size, strategy == "pipeline")
            got[strategy] = (losses, pipeline_worker._weights(dmp), getattr(dmp, "dense_stages", None))
        ref, pipe, stages = got["ddp"][1], got["pipeline"][1], got["pipeline"][2]
        assert pipe.keys() <= ref.keys()  # a pipeline rank holds its own stages' dense weights only
        out[extra] = {
            "ddp": got["ddp"][0],
            "pipeline": got["pipeline"][0],
            "table_diff": max(float((ref[k] - pipe[k]).abs().max()) for k in ref if "embedding" in k),
            "dense_rel": max(
                float((ref[k] - pipe[k]).norm() / (ref[k] - first[k]).norm().clamp_min(1e-12))
                for k in pipe
                if "embedding" not in k
            ),
            "starts": stages.starts,
            "owned": [type(m).__name__ for m in stages.own_modules()],
        }
    return out
