"""Managed-collision tables, sharded vs unsharded: one rank's side (run via run_ranks).

The reference is one unsharded CTRTask whose ManagedRemap records each step's global batch
once (in rank order, as the sharded ranks' all_gather gives it), then scores every rank's
slice with that state; embeddings and dense weights are trained as in equivalence.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsys_dist.data.loader import CTRBatch
from recsys_dist.distributed.optim import EMBEDDING_OPTIMIZERS, build_optimizer
from recsys_dist.distributed.sharders import sharders
from recsys_dist.distributed.tables import gather_full_state_dict, load_full_state_dict
from recsys_dist.models.managed import ManagedRemap, ReplicatedMCH, find_remap
from recsys_dist.models.task import CTRTask
from tests.ranks.distributed.equivalence import (
    DENSE_LR,
    EMB_LR,
    TABLES,
    Tiny,
    configs,
    global_batch,
    reference_embedding_step,
)

STEPS = 7
BIG = 1 << 40  # raw ids far beyond every table: only the managed module can map them


def remap_module(eviction: str, interval: int, admission: int, world_size: int, ttl: int | None = None) -> ManagedRemap:
    from tests.ranks.distributed.equivalence import B

    return ManagedRemap(
        {
            f"f_{name}": ReplicatedMCH(
                zch_size=rows // 4 + 3,  # far fewer rows than distinct ids: evictions happen
                eviction=eviction,
                eviction_interval=interval,
                admission_min_count=admission,
                history_capacity=interval * B * world_size * hot,
                name=f"f_{name}",
                ttl_steps=ttl,
            )
            for name, rows, _, _, hot in TABLES
        }
    )


def raw_batches(step: int, world_size: int) -> list[CTRBatch]:
    """equivalence.global_batch with each id i turned into a skewed raw 41-bit id."""
    out = []
    for b in global_batch(step, world_size):
        kjt = b.sparse_features
        v = kjt.values()
        raw = BIG + (v * v) // 7 * 1_000_003  # skewed: small ids collapse onto frequent raw ids
        out.append(
            CTRBatch(
                dense_features=b.dense_features,
                sparse_features=KeyedJaggedTensor(
                    keys=kjt.keys(), values=raw, lengths=kjt.lengths(), stride=kjt.stride()
                ),
                labels=b.labels,
                weights=b.weights,
            )
        )
    return out


def concat(batches: list[CTRBatch]) -> KeyedJaggedTensor:
    """The global batch's KJT: per key, every rank's bags in rank order."""
    dicts = [b.sparse_features.to_dict() for b in batches]
    keys = batches[0].sparse_features.keys()
    values = torch.cat([d[k].values() for k in keys for d in dicts])
    lengths = torch.cat([d[k].lengths() for k in keys for d in dicts])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=sum(b.labels.numel() for b in batches))


def state_of(remap: ManagedRemap) -> dict:
    return {k: v.clone() for k, v in remap.state_dict().items()}


def check_all(rank: int, world_size: int, cases: list[tuple]) -> dict:
    return {case: check(rank, world_size, *case) for case in cases}


def check(
    rank: int, world_size: int, sharding_type: str, eviction: str, interval: int, admission: int, ttl: int | None = None
) -> dict:
    """Train STEPS steps sharded and unsharded; largest differences, remap state equality
    (TTL last-seen steps and cumulative counters included), eviction counts, and this rank's
    and the reference's cumulative counters (``CTRTask.managed_counters``)."""
    optimizer = "exact_rowwise_adagrad"
    torch.manual_seed(0)
    ref = CTRTask(
        Tiny(EmbeddingBagCollection(tables=_small(), device=torch.device("cpu"))),
        remap=remap_module(eviction, interval, admission, world_size, ttl),
    )
    with torch.no_grad():
        for p in ref.model.sparse_arch.parameters():
            p.uniform_(-0.1, 0.1)
    full = {k: v.clone() for k, v in ref.state_dict().items()}

    model = CTRTask(
        Tiny(EmbeddingBagCollection(tables=_small(), device=torch.device("meta"))),
        remap=remap_module(eviction, interval, admission, world_size, ttl),
    )
    cls, kwargs = EMBEDDING_OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, model.model.sparse_arch.parameters(), {"lr": EMB_LR, **kwargs})
    kernel = "dense" if sharding_type == "data_parallel" else "fused"
    cons = {n: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=[kernel]) for n, *_ in TABLES}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size), constraints=cons
    )
    plan = planner.collective_plan(model, sharders(), dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders())
    planned = {ps.sharding_type for mp in plan.plan.values() for ps in mp.values()}
    assert planned == {sharding_type}, f"asked for {sharding_type}, planner chose {planned}"
    load_full_state_dict(dmp.state_dict(), full)
    dense_opt = build_optimizer(dmp, optimizer, EMB_LR, "adagrad", DENSE_LR)

    ref_emb = {n: p for n, p in ref.named_parameters() if "sparse_arch" in n}
    ref_dense = [p for n, p in ref.named_parameters() if "sparse_arch" not in n]
    ref_dense_opt = torch.optim.Adagrad(ref_dense, lr=DENSE_LR)
    ref_state = {n: {} for n in ref_emb}
    diffs = {"logits": 0.0, "loss": 0.0}
    remap_ref = ref.remap
    remap_ref.gather = False  # one process's reference: it records the global batch itself
    for step in range(STEPS):
        batches = raw_batches(step, world_size)
        loss, (_, logits, _, _) = dmp(batches[rank])
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()

        remap_ref.train()
        remap_ref(concat(batches))  # record the global batch once (the remapped output is not used)
        remap_ref.eval()
        ref_dense_opt.zero_grad()
        for p in ref_emb.values():
            p.grad = None
        ref_losses, ref_logits = [], []
        for b in batches:
            lo, (_, lg, _, _) = ref(b)
            ref_losses.append(lo)
            ref_logits.append(lg)
        torch.stack(ref_losses).mean().backward()
        ref_dense_opt.step()
        with torch.no_grad():
            for n, p in ref_emb.items():
                reference_embedding_step(p, p.grad, ref_state[n], optimizer, lazy=sharding_type != "data_parallel")
        diffs["logits"] = max(diffs["logits"], (logits.detach() - ref_logits[rank].detach()).abs().max().item())
        diffs["loss"] = max(diffs["loss"], abs(loss.item() - ref_losses[rank].item()))

    got = gather_full_state_dict(dmp.state_dict())
    want = ref.state_dict()
    remap_equal = True
    for name, t in want.items():
        assert got[name].shape == t.shape, (name, got[name].shape, t.shape)
        if name.startswith("remap."):
            remap_equal &= bool(torch.equal(got[name], t))
        else:
            diffs[name] = (got[name] - t).abs().max().item()
    stats = {f: m.stats() for f, m in find_remap(dmp).mch.items()}
    counters = {"rank": dmp.module.managed_counters(), "reference": ref.managed_counters()}  # the model's hook
    return {"diffs": diffs, "remap_equal": remap_equal, "stats": stats, "counters": counters}


def _small():
    """equivalence.configs() with each table cut to the managed module's rows."""
    out = []
    for c, (_, rows, *_rest) in zip(configs(), TABLES):
        c.num_embeddings = rows // 4 + 3
        out.append(c)
    return out
