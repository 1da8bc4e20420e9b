"""``distributed.dense.strategy: fsdp`` against ``ddp``: one rank's side (run via run_ranks).

Both strategies go through the trainer's sharding path (``recsys_dist.train.build.shard_model``)
from the same seed, and train on the same per-rank batches; the losses, the dense bytes each
rank holds, and a checkpoint written under one strategy and resumed under the other are compared.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from recsys_dist.checkpoint.dcp import canonical_optimizer_state, load_checkpoint, save_checkpoint, set_optimizer_steps
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.distributed.comm_counter import CommCounter
from recsys_dist.distributed.dense import is_ddp_wrapped, local_dense_bytes, optimizer_state_bytes
from recsys_dist.distributed.env import init_distributed
from recsys_dist.distributed.ledger import run_ledger
from recsys_dist.distributed.optim import dense_torch_optimizer, init_lazy_state
from recsys_dist.models.registry import get_model
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
    return resolve_job(load_config(QUICKSTART, overrides))


def _batch(step: int, rank: int, world_size: int):
    batch = criteo_batch(torch.Generator().manual_seed(100 + step * world_size + rank), B)
    values = batch.sparse_features.values() % 200  # data.num_embeddings=200
    kjt = type(batch.sparse_features)(
        keys=batch.sparse_features.keys(), values=values, lengths=batch.sparse_features.lengths(), stride=B
    )
    return type(batch)(batch.dense_features, kjt, batch.labels, batch.weights)


class WithBias(nn.Module):
    """A user's model with a parameter set directly on the module that holds the tables: under
    fsdp it is in no block, so it stays replicated under DDP (recsys_dist.distributed.dense)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.bias = nn.Parameter(torch.full((1,), 0.3))

    def forward(self, dense, kjt):
        return self.inner(dense, kjt) + self.bias


def _with_bias(cfg):
    return lambda spec: WithBias(get_model("dlrm").build(spec, cfg.model))


def _build(cfg, ctx, user_model: bool = False):
    # A different seed per rank: both strategies must start from rank 0's dense weights (as DDP does).
    torch.manual_seed(cfg.train.seed + ctx.rank)
    return shard_model(cfg, ctx, module=_with_bias(cfg) if user_model else None)[:2]


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


def losses_and_bytes(rank: int, world_size: int, cases: list, steps: int) -> dict:
    """Per case ``(model name, sharding types, extra overrides)`` and strategy: the losses of
    ``steps`` steps, this rank's dense bytes (parameters, gradients before the last zero_grad,
    Adam state), the sharding types planned, and the bytes of the last step on the wire per
    phase: ``counted`` at the collectives (CommCounter) and ``predicted`` (the run's ledger)."""
    out: dict = {}
    for name, types, extra in cases:
        for strategy in ("ddp", "fsdp"):
            cfg = _cfg(name.removesuffix("+bias"), types, strategy, world_size, extra)
            ctx = init_distributed(cfg.distributed)
            dmp, opt = _build(cfg, ctx, user_model=name.endswith("+bias"))
            with CommCounter(dmp) as counter:
                losses = _train(dmp, opt, range(steps - 1), rank, world_size)
                counter.reset()
                loss = dmp(_batch(steps - 1, rank, world_size))[0]
                loss.backward()
                opt.step()
                counted = {k: dict(v) for k, v in counter.counts.items()}
            sizes = _bytes(dmp, opt)
            opt.zero_grad()
            sizes["ddp_wrapped"] = is_ddp_wrapped(dmp)
            predicted = run_ledger(dmp, cfg.data, cfg.sharding.comms, B, world_size).per_rank()[rank]
            out[(name, tuple(types), tuple(extra), strategy)] = {
                "losses": [*losses, loss.item()],
                "bytes": sizes,
                "planned": sorted({ps.sharding_type for mp in dmp.plan.plan.values() for ps in mp.values()}),
                "wire": {"counted": counted, "predicted": predicted},
            }
    return out


def _state(dmp, opt) -> dict:
    return {"model": dmp.state_dict(), "optimizer": canonical_optimizer_state(opt.state_dict())}


def resume_across(rank: int, world_size: int, run_dir: str, first: str, then: str, steps: int) -> dict:
    """Train ``steps`` under ``first``, save, train ``steps`` more (``want``); then a fresh model
    under ``then`` (other initial weights) loads the checkpoint and trains the same batches
    (``got``); ``fresh``: the same without the load (shows the checkpoint is what makes them equal)."""
    cfg = _cfg("dcnv2", ["row_wise", "table_wise"], first, world_size)
    ctx = init_distributed(cfg.distributed)
    dmp, opt = _build(cfg, ctx)
    _train(dmp, opt, range(steps), rank, world_size)
    path = save_checkpoint(ctx, run_dir, steps, _state(dmp, opt), {"step": steps}, keep=5)
    want = _train(dmp, opt, range(steps, 2 * steps), rank, world_size)
    cfg2 = _cfg("dcnv2", ["row_wise", "table_wise"], then, world_size)
    out = {"want": want}
    for key, load in (("got", True), ("fresh", False)):
        torch.manual_seed(123)  # other initial dense weights: only the checkpoint can make them equal
        other, opt2 = shard_model(cfg2, ctx)[:2]
        if load:
            init_lazy_state(opt2, other.fused_optimizer)
            load_checkpoint(path, _state(other, opt2))
            set_optimizer_steps(opt2, steps)  # as the Trainer's resume: step counters are not checkpointed
        out[key] = _train(other, opt2, range(steps, 2 * steps), rank, world_size)
        out[f"{key}_dtensors"] = sum(isinstance(p, DTensor) for p in other.parameters())
    return out


def _movielens_batch(step: int, rank: int, world_size: int, job):
    """A random batch in a MovieLens schema config's layout (one-hot ids, genres bags of 0-3,
    a history of 0-12 ids when the config has one), ids < 200, a label per task."""
    from torchrec import KeyedJaggedTensor

    from recsys_dist.data.loader import CTRBatch

    g = torch.Generator().manual_seed(1000 + step * world_size + rank)
    keys, multi, seqs = job.features.keys, set(job.data.schema.multi_hot), set(job.features.sequence_names)
    per_key = {}
    for k in keys:  # a history's actions (times) come one per event: its lengths
        if k.endswith(("_action", "_time")) and k.rsplit("_", 1)[0] in per_key:
            per_key[k] = per_key[k.rsplit("_", 1)[0]]
        else:
            per_key[k] = (
                torch.randint(0, 13, (B,), generator=g)
                if k in seqs
                else torch.randint(0, 4, (B,), generator=g)
                if k in multi
                else torch.ones(B, dtype=torch.int64)
            )
    lengths = torch.cat([per_key[k] for k in keys])
    kjt = KeyedJaggedTensor(
        keys=list(keys), values=torch.randint(0, 200, (int(lengths.sum()),), generator=g), lengths=lengths, stride=B
    )
    kinds = job.features.task_kinds
    labels = torch.stack(
        [
            torch.rand(B, generator=g) * 5 if k == "regression" else torch.randint(0, 2, (B,), generator=g).float()
            for k in kinds
        ],
        1,
    )
    return CTRBatch(torch.zeros(B, 0), kjt, labels.squeeze(1) if len(kinds) == 1 else labels, torch.ones(B))


def model_losses(rank: int, world_size: int, cases: list, steps: int) -> dict:
    """Per case ``(config path, overrides)`` and strategy: the losses of ``steps`` steps of the
    config's model (a sequence or multi-task one) through the trainer's sharding path on random
    batches in its layout, and the dense bytes of the last step on the wire (``counted`` at the
    collectives, ``predicted`` by the run's ledger; EmbeddingCollection tables are not in the ledger)."""
    out: dict = {}
    for config, overrides in cases:
        for strategy in ("ddp", "fsdp"):
            base = [
                "data.categorical_mapping=hash",
                "data.num_embeddings=200",
                f"distributed.nproc_per_node={world_size}",
                f"distributed.dense.strategy={strategy}",
                "distributed.cpu_threads_per_rank=1",
            ]
            job = resolve_job(load_config(config, [*base, *overrides]))
            ctx = init_distributed(job.distributed)
            torch.manual_seed(job.train.seed + ctx.rank)  # only rank 0's dense weights may count
            dmp, opt = shard_model(job, ctx)[:2]
            losses = []
            with CommCounter(dmp) as counter:
                for step in range(steps):
                    counter.reset()
                    loss = dmp(_movielens_batch(step, rank, world_size, job))[0]
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                counted = {k: dict(v) for k, v in counter.counts.items()}
            predicted = run_ledger(dmp, job.data, job.sharding.comms, B, world_size).per_rank()[rank]
            out[(str(config), tuple(overrides), strategy)] = {
                "losses": losses,
                "wire": {"counted": counted, "predicted": predicted},
                "dtensors": sum(isinstance(p, DTensor) for p in dmp.parameters()),
                "model": type(dmp.module.model).__name__ if hasattr(dmp.module, "model") else type(dmp.module).__name__,
            }
    return out
