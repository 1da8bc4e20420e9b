"""``distributed.dense.strategy: fsdp`` against ``ddp``: one rank's side (run via run_ranks).

Both strategies go through the trainer's sharding path (``recsys_dist.train.build.shard_model``)
from the same seed, and train on the same per-rank batches; the losses, the dense bytes each
rank holds, and a checkpoint written under one strategy and resumed under the other are compared.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from recsys_dist.checkpoint.dcp import canonical_optimizer_state, load_checkpoint, save_checkpoint, set_optimizer_steps
from recsys_dist.config.loader import load_config
from recsys_dist.distributed.dense import local_dense_bytes, optimizer_state_bytes
from recsys_dist.distributed.env import init_distributed
from recsys_dist.distributed.optim import dense_torch_optimizer, init_lazy_state
from recsys_dist.train.build import shard_model
from tests.conftest import QUICKSTART
from tests.ranks.distributed.equivalence import criteo_batch

B = 8


def _cfg(name: str, types: list[str], strategy: str, world_size: int, extra: tuple = ()):
    overrides = [
        f"model.name={name}",  # the quickstart's dlrm tower; dcnv2 with its defaults
        f"sharding.sharding_types=[{', '.join(types)}]",
        f"distributed.dense.strategy={strategy}",
        f"distributed.nproc_per_node={world_size}",
        "data.num_embeddings=200",
        "train.dense_optimizer=adam",
        "train.dense_lr=0.01",
        "distributed.cpu_threads_per_rank=1",
        *extra,
    ]
    return load_config(QUICKSTART, overrides)


def _batch(step: int, rank: int, world_size: int):
    batch = criteo_batch(torch.Generator().manual_seed(100 + step * world_size + rank), B)
    values = batch.sparse_features.values() % 200  # data.num_embeddings=200
    kjt = type(batch.sparse_features)(
        keys=batch.sparse_features.keys(), values=values, lengths=batch.sparse_features.lengths(), stride=B
    )
    return type(batch)(batch.dense_features, kjt, batch.labels, batch.weights)


def _build(cfg, ctx):
    torch.manual_seed(cfg.train.seed)
    return shard_model(cfg, ctx)[:2]


def _train(dmp, opt, steps: range, rank: int, world_size: int) -> list[float]:
    losses = []
    for step in steps:
        loss = dmp(_batch(step, rank, world_size))[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _bytes(dmp, opt) -> dict:
    out = local_dense_bytes(dmp)
    dense = [p for n, p in dmp.named_parameters() if "embedding" not in n]
    out["optimizer"] = optimizer_state_bytes(dense_torch_optimizer(opt), dense)
    out["dtensors"] = sum(isinstance(p, DTensor) for p in dense)
    return out


def losses_and_bytes(rank: int, world_size: int, cases: list, steps: int, extra: tuple = ()) -> dict:
    """Per (model, sharding types) case and strategy: the losses of ``steps`` steps, and this
    rank's dense bytes (parameters, gradients before the last zero_grad, Adam state)."""
    out: dict = {}
    for name, types in cases:
        for strategy in ("ddp", "fsdp"):
            cfg = _cfg(name, types, strategy, world_size, extra)
            ctx = init_distributed(cfg)
            dmp, opt = _build(cfg, ctx)
            losses = _train(dmp, opt, range(steps - 1), rank, world_size)
            loss = dmp(_batch(steps - 1, rank, world_size))[0]
            loss.backward()
            opt.step()
            sizes = _bytes(dmp, opt)
            opt.zero_grad()
            types_planned = sorted({ps.sharding_type for mp in dmp.plan.plan.values() for ps in mp.values()})
            out[(name, tuple(types), strategy)] = {
                "losses": [*losses, loss.item()],
                "bytes": sizes,
                "planned": types_planned,
            }
    return out


def _state(dmp, opt, rank: int) -> dict:
    return {"model": dmp.state_dict(), "optimizer": canonical_optimizer_state(opt.state_dict())}


def resume_across(rank: int, world_size: int, run_dir: str, first: str, then: str, steps: int) -> dict:
    """Train ``steps`` under ``first``, save, train ``steps`` more (the reference losses); then a
    fresh model under ``then`` loads the checkpoint and trains the same ``steps`` batches."""
    cfg = _cfg("dcnv2", ["row_wise", "table_wise"], first, world_size)
    ctx = init_distributed(cfg)
    dmp, opt = _build(cfg, ctx)
    _train(dmp, opt, range(steps), rank, world_size)
    path = save_checkpoint(ctx, run_dir, steps, _state(dmp, opt, rank), {"step": steps}, keep=5)
    want = _train(dmp, opt, range(steps, 2 * steps), rank, world_size)
    cfg2 = _cfg("dcnv2", ["row_wise", "table_wise"], then, world_size)
    torch.manual_seed(123)  # other initial weights: only the checkpoint can make them equal
    other, opt2 = shard_model(cfg2, ctx)[:2]
    init_lazy_state(opt2, other.fused_optimizer)
    load_checkpoint(path, _state(other, opt2, rank))
    set_optimizer_steps(opt2, steps)  # as the Trainer's resume: step counters are not checkpointed
    got = _train(other, opt2, range(steps, 2 * steps), rank, world_size)
    return {"want": want, "got": got}
