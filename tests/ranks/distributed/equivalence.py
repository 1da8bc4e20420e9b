"""Sharded vs unsharded: one rank's side of the equivalence check (run via run_ranks).

Reference semantics (what TorchRec does, written out in plain torch):
- every rank computes the weighted mean loss of its own batch slice;
- dense gradients are averaged over ranks (DDP);
- embedding gradients are averaged over ranks too (TorchRec scales the pooled-embedding
  gradients by 1/world_size in output_dist's backward; measured: a sum-of-ranks reference
  is off by exactly 2x at world size 2), then the fused optimizer is applied once.
So the reference is one unsharded model trained on the mean of the per-rank losses.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsys_dist.data.loader import CTRBatch
from recsys_dist.distributed.optim import EMBEDDING_OPTIMIZERS, build_optimizer, fused_weight_decay
from recsys_dist.distributed.sharders import sharders
from recsys_dist.distributed.tables import gather_full_state_dict, load_full_state_dict
from recsys_dist.models.task import CTRTask

# name, rows, dim, pooling, max ids per example (0 allows empty bags)
TABLES = [("t0", 1000, 8, PoolingType.SUM, 3), ("t1", 50, 8, PoolingType.MEAN, 4), ("t2", 31, 12, PoolingType.SUM, 1)]

B, NUM_DENSE, EMB_LR, DENSE_LR, EPS = 4, 4, 0.1, 0.1, 1e-8
STEPS = int(os.environ.get("EQ_STEPS", 3))


class Tiny(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.sparse_arch = ebc
        self.bottom = nn.Linear(NUM_DENSE, 8)
        self.over = nn.Linear(8 + sum(t[2] for t in TABLES), 1)

    def forward(self, dense, kjt):
        # By feature (positional reads are tests/ranks/distributed/test_key_order.py's).
        kt = self.sparse_arch(kjt).to_dict()
        pooled = torch.cat([kt[f"f_{t[0]}"] for t in TABLES], dim=1)
        return self.over(torch.cat([torch.relu(self.bottom(dense)), pooled], dim=1))


def configs(shared_feature: bool = False):
    out = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"], pooling=p)
        for n, r, d, p, _ in TABLES
    ]
    return out


def global_batch(step: int, world_size: int) -> list[CTRBatch]:
    g = torch.Generator().manual_seed(1000 + step)
    batches = []
    for _ in range(world_size):
        lengths = torch.cat([torch.randint(0 if h > 1 else 1, h + 1, (B,), generator=g) for *_, h in TABLES])
        values = torch.cat(
            [
                torch.randint(0, rows, (int(l),), generator=g)
                for l, rows in zip(lengths.tolist(), [t[1] for t in TABLES for _ in range(B)])
            ]
        )
        kjt = KeyedJaggedTensor(keys=[f"f_{t[0]}" for t in TABLES], values=values, lengths=lengths.int(), stride=B)
        batches.append(
            CTRBatch(
                dense_features=torch.randn(B, NUM_DENSE, generator=g),
                sparse_features=kjt,
                labels=torch.randint(0, 2, (B,), generator=g).float(),
                weights=torch.ones(B),
            )
        )
    return batches


def reference_embedding_step(weight, grad, state, optimizer, lazy=True, weight_decay=0.0):
    """One optimizer step on a full table in plain torch; ``state`` is a dict kept across steps.

    ``weight_decay`` decays only the rows of the batch (non-zero gradient), as FBGEMM does:
    L2 (added to the gradient) for row-wise Adagrad, decoupled (AdamW) for Adam."""
    touched = (grad != 0).any(dim=1)
    if weight_decay and optimizer == "adam":
        weight[touched] -= EMB_LR * weight_decay * weight[touched]
    elif weight_decay:
        grad = grad.clone()
        grad[touched] += weight_decay * weight[touched]
    if optimizer == "exact_sgd":
        weight -= EMB_LR * grad
    elif optimizer == "exact_rowwise_adagrad":
        acc = state.setdefault("acc", torch.zeros(weight.shape[0]))
        acc += (grad * grad).mean(dim=1)
        weight -= EMB_LR * grad / (acc.sqrt() + EPS)[:, None]
    elif optimizer == "exact_adagrad":
        acc = state.setdefault("acc", torch.zeros_like(weight))
        acc += grad * grad
        weight -= EMB_LR * grad / (acc.sqrt() + EPS)
    elif optimizer == "adam":
        # FBGEMM's Adam is lazy (rows absent from the batch keep weights and moments);
        # torch.optim.Adam on a replicated table is not.
        m = state.setdefault("m", torch.zeros_like(weight))
        v = state.setdefault("v", torch.zeros_like(weight))
        state["t"] = t = state.get("t", 0) + 1
        rows = (grad != 0).any(dim=1) if lazy else torch.ones(weight.shape[0], dtype=torch.bool)
        m[rows] = 0.9 * m[rows] + 0.1 * grad[rows]
        v[rows] = 0.999 * v[rows] + 0.001 * grad[rows] ** 2
        update = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + EPS)
        weight[rows] -= EMB_LR * update[rows]
    else:
        raise ValueError(optimizer)


def check_all(rank: int, world_size: int, cases: list[tuple[str, str]], device_type: str = "cpu") -> dict:
    """One spawn serves every (sharding_type, optimizer) case."""
    return {case: check(rank, world_size, *case, device_type=device_type) for case in cases}


def check(
    rank: int,
    world_size: int,
    sharding_type: str,
    optimizer: str,
    device_type: str = "cpu",
    weight_decay: float = 0.0,
    tables_out: dict | None = None,
) -> dict:
    """Train 3 steps sharded and unsharded; return the largest absolute differences.

    ``weight_decay``: ``train.embedding_weight_decay`` (build_optimizer's, and the fused kwargs
    of recsys_dist.distributed.optim.fused_weight_decay). ``tables_out``: filled with the final full tables."""

    torch.manual_seed(0)
    ref = CTRTask(Tiny(EmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))))
    with torch.no_grad():
        for p in ref.model.sparse_arch.parameters():
            p.uniform_(-0.1, 0.1)
    full = {k: v.clone() for k, v in ref.state_dict().items()}

    model = CTRTask(Tiny(EmbeddingBagCollection(tables=configs(), device=torch.device("meta"))))
    cls, kwargs = EMBEDDING_OPTIMIZERS[optimizer]
    kwargs = {**kwargs, **fused_weight_decay(optimizer, weight_decay)}
    apply_optimizer_in_backward(cls, model.model.sparse_arch.parameters(), {"lr": EMB_LR, **kwargs})
    kernel = "dense" if sharding_type == "data_parallel" else "fused"
    cons = {n: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=[kernel]) for n, *_ in TABLES}
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    model.model.bottom.to(device)
    model.model.over.to(device)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device_type, local_world_size=world_size),
        constraints=cons,
    )
    plan = planner.collective_plan(model, sharders(), dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders())
    planned = {ps.sharding_type for mp in plan.plan.values() for ps in mp.values()}
    assert planned == {sharding_type}, f"asked for {sharding_type}, planner chose {planned}"
    load_full_state_dict(dmp.state_dict(), full)
    dense_opt = build_optimizer(dmp, optimizer, EMB_LR, "adagrad", DENSE_LR, embedding_weight_decay=weight_decay)

    ref_emb = {n: p for n, p in ref.named_parameters() if "sparse_arch" in n}
    ref_dense = [p for n, p in ref.named_parameters() if "sparse_arch" not in n]
    ref_dense_opt = torch.optim.Adagrad(ref_dense, lr=DENSE_LR)
    ref_state = {n: {} for n in ref_emb}
    diffs = {"logits": 0.0, "loss": 0.0}
    for step in range(STEPS):
        batches = global_batch(step, world_size)
        loss, (_, logits, _, _) = dmp(batches[rank].to(device))
        logits = logits.cpu()
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()

        ref_dense_opt.zero_grad()
        for p in ref_emb.values():
            p.grad = None
        ref_losses, ref_logits = [], []
        for b in batches:
            l, (_, lg, _, _) = ref(b)
            ref_losses.append(l)
            ref_logits.append(lg)
        torch.stack(ref_losses).mean().backward()
        ref_dense_opt.step()
        with torch.no_grad():
            for n, p in ref_emb.items():
                lazy = sharding_type != "data_parallel"
                reference_embedding_step(p, p.grad, ref_state[n], optimizer, lazy, weight_decay)
        diffs["logits"] = max(diffs["logits"], (logits.detach() - ref_logits[rank].detach()).abs().max().item())
        diffs["loss"] = max(diffs["loss"], abs(loss.item() - ref_losses[rank].item()))

    got = gather_full_state_dict(dmp.state_dict())
    want = ref.state_dict()
    for name, t in want.items():
        diffs[name] = (got[name] - t).abs().max().item()
        assert got[name].shape == t.shape, (name, got[name].shape, t.shape)
    if tables_out is not None:
        tables_out.update({k: v for k, v in got.items() if "sparse_arch" in k})
    return diffs


WEIGHT_DECAY = 0.5


def weight_decay_checks(rank: int, world_size: int, cases: list[tuple[str, str]], device_type: str = "cpu") -> dict:
    """``train.embedding_weight_decay`` per (sharding_type, optimizer) case: ``check``'s
    differences to the decayed reference, and ``effect``, the largest change of a table
    against the same run without decay (0 if the decay were ignored). On CPU also the
    refusal of row_wise (FBGEMM's CPU fused kernel ignores weight decay)."""
    out: dict = {}
    for case in cases:
        decayed, plain = {}, {}
        diffs = check(rank, world_size, *case, device_type, weight_decay=WEIGHT_DECAY, tables_out=decayed)
        check(rank, world_size, *case, device_type, tables_out=plain)
        out[case] = {"diffs": diffs, "effect": max((decayed[k] - plain[k]).abs().max().item() for k in plain)}
    if device_type == "cpu":
        out["row_wise_on_cpu"] = _error(
            lambda: check(rank, world_size, "row_wise", "exact_rowwise_adagrad", weight_decay=WEIGHT_DECAY)
        )
    out["fbgemm_args"] = _fused_decay_args(device_type)
    return out


def _fused_decay_args(device_type: str) -> list[tuple[float, int]]:
    """(weight_decay, weight_decay_mode) of every FBGEMM kernel of a row_wise EBC marked with
    fuse_embedding_optimizer's kwargs for exact_rowwise_adagrad (what the CUDA kernel reads)."""
    import recsys_dist

    ebc = EmbeddingBagCollection(tables=configs(), device=torch.device("meta"))
    cls, kwargs = EMBEDDING_OPTIMIZERS["exact_rowwise_adagrad"]
    kwargs = {"lr": EMB_LR, **kwargs, **fused_weight_decay("exact_rowwise_adagrad", WEIGHT_DECAY)}
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dmp = recsys_dist.shard(ebc, {"sharding_types": ["row_wise"]}, device=device)
    kernels = [e._emb_module for lookup in dmp._dmp_wrapped_module._lookups for e in lookup._emb_modules]
    return [(k.optimizer_args.weight_decay, k.optimizer_args.weight_decay_mode) for k in kernels]


def shard_api_forward(rank: int, world_size: int, sharding: dict) -> dict:
    """A user's own model through ``recsys_dist.shard``: plan types and forward vs unsharded."""
    import recsys_dist

    torch.manual_seed(0)
    ref = Tiny(EmbeddingBagCollection(tables=configs(), device=torch.device("cpu")))
    full = {k: v.clone() for k, v in ref.state_dict().items()}
    dmp = recsys_dist.shard(Tiny(EmbeddingBagCollection(tables=configs(), device=torch.device("meta"))), sharding)
    load_full_state_dict(dmp.state_dict(), full)
    batch = global_batch(0, world_size)[rank]
    got = dmp(batch.dense_features, batch.sparse_features)
    want = ref(batch.dense_features, batch.sparse_features)
    types = sorted({ps.sharding_type for mp in dmp.plan.plan.values() for ps in mp.values()})
    return {"types": types, "max_diff": (got - want).abs().max().item()}


def shared_feature_forward(rank: int, world_size: int, sharding_types: list[str]) -> dict:
    """One feature feeding two tables: both lookups come back, equal to unsharded."""
    import recsys_dist

    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=50, feature_names=["f"]),
    ]
    out = {}
    for st in sharding_types:
        torch.manual_seed(0)
        ref = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        dmp = recsys_dist.shard(
            EmbeddingBagCollection(tables=tables, device=torch.device("meta")), {"sharding_types": [st]}
        )
        load_full_state_dict(dmp.state_dict(), ref.state_dict())
        kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2, 3, 40, 7]), lengths=torch.tensor([2, 0, 3]))
        got, want = dmp(kjt).to_dict(), ref(kjt).to_dict()
        out[st] = (sorted(got), max((got[k] - want[k]).abs().max().item() for k in want))
    return out


def init_is_sharding_independent(rank: int, world_size: int, sharding_types: list[str]) -> dict:
    """recsys_dist.distributed.tables.init_tables gives the same full tables whatever the sharding."""
    import recsys_dist
    from recsys_dist.distributed.tables import init_tables

    out = {}
    for st in sharding_types:
        dmp = recsys_dist.shard(
            EmbeddingBagCollection(tables=configs(), device=torch.device("meta")), {"sharding_types": [st]}
        )
        init_tables(dmp.state_dict(), configs(), seed=7, scales={n: 0.1 for n, *_ in TABLES})
        out[st] = gather_full_state_dict(dmp.state_dict())
    return out


def criteo_batch(g: torch.Generator, B: int) -> CTRBatch:
    """A random one-hot batch in the quickstart's layout (13 dense, C1..C26 ids < 10,000)."""
    kjt = KeyedJaggedTensor(
        keys=[f"C{i}" for i in range(1, 27)],
        values=torch.randint(0, 10000, (26 * B,), generator=g),
        lengths=torch.ones(26 * B, dtype=torch.int32),
        stride=B,
    )
    return CTRBatch(
        dense_features=torch.rand(B, 13, generator=g),
        sparse_features=kjt,
        labels=torch.randint(0, 2, (B,), generator=g).float(),
        weights=torch.ones(B),
    )


# Options a model needs on the Criteo quickstart besides model.name.
MODEL_OVERRIDES = {
    "two_tower": [
        "model.user_features=[C1, C2]",
        "model.item_features=[C3, C4, C5]",
        "model.item_id=C3",
        "train.loss=in_batch_softmax",
    ]
}


def sharded_and_unsharded(job, batch: CTRBatch) -> tuple:
    """The model of ``job`` through the trainer's sharding path (``shard_model``) and unsharded
    with the same weights (copied from the sharded one), both in eval mode on ``batch``:
    (sharded output, unsharded output), each CTRTask's (loss, (loss, logits, labels))."""
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.train.build import build_task, shard_model

    ctx = init_distributed(job.distributed)
    torch.manual_seed(0)
    ref = build_task(job, job.features.on(torch.device("cpu"), torch.device("cpu")))
    dmp, _, _ = shard_model(job, ctx)
    load_full_state_dict(dmp.state_dict(), ref.state_dict())
    dmp.eval(), ref.eval()
    return dmp(batch), ref(batch)


def models_sharded_vs_unsharded(rank: int, world_size: int, names: list[str]) -> dict:
    """Each zoo model through the trainer's sharding path: same logits as unsharded."""
    import recsys_dist
    from recsys_dist.config.loader import load_config
    from tests.conftest import QUICKSTART

    out = {}
    for name in names:
        extra = MODEL_OVERRIDES.get(name, [])
        cfg = load_config(QUICKSTART, [f"model.name={name}", "sharding.sharding_types=[row_wise, table_wise]", *extra])
        got, want = sharded_and_unsharded(
            recsys_dist.resolve_job(cfg), criteo_batch(torch.Generator().manual_seed(5), 8)
        )
        # the logits, and the loss (two_tower's reads [B, B] candidate scores besides them)
        out[name] = max((got[1][1] - want[1][1]).abs().max().item(), (got[0] - want[0]).abs().item())
    return out


def one_rank_without_ddp(rank: int, world_size: int, steps: int) -> dict:
    """The trainer at world size 1 leaves the dense modules out of DDP; training is the same
    as with DDP (losses and dense weights after ``steps`` steps). Also reports the intra-op
    threads set from ``distributed.cpu_threads_per_rank``."""
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.distributed import DistributedModelParallel

    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.distributed.optim import build_optimizer, fuse_embedding_optimizer
    from recsys_dist.distributed.plan import World
    from recsys_dist.train.build import build_task, plan_job, shard_model
    from tests.conftest import QUICKSTART

    job = resolve_job(
        load_config(
            QUICKSTART, ["model.name=deepfm", "distributed.nproc_per_node=1", "distributed.cpu_threads_per_rank=3"]
        )
    )
    ctx = init_distributed(job.distributed)
    threads = torch.get_num_threads()
    ours, opt_ours, _ = shard_model(job, ctx)
    model = build_task(job, job.features.on(torch.device("meta"), ctx.device))
    fuse_embedding_optimizer(
        model, job.train.embedding_optimizer, job.train.embedding_lr, job.train.embedding_weight_decay
    )
    plan = plan_job(
        job, model, World(ctx.world_size, ctx.local_world_size, ctx.device.type, torch.distributed.group.WORLD)
    )
    ddp = DistributedModelParallel(model, device=ctx.device, plan=plan, sharders=sharders())
    load_full_state_dict(ddp.state_dict(), gather_full_state_dict(ours.state_dict()))
    t = job.train
    opt_ddp = build_optimizer(
        ddp,
        t.embedding_optimizer,
        t.embedding_lr,
        t.dense_optimizer,
        t.dense_lr,
        t.dense_grad_clip_norm,
        t.embedding_weight_decay,
    )
    losses = {"ours": [], "ddp": []}
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        batch = criteo_batch(g, 16)
        for name, dmp, opt in (("ours", ours, opt_ours), ("ddp", ddp, opt_ddp)):
            loss = dmp(batch)[0]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    dense = {
        n: (p.detach() - dict(ddp.named_parameters())[n].detach()).abs().max().item()
        for n, p in ours.named_parameters()
        if "embedding_bags" not in n
    }
    return {
        "wrapped": [type(m._dmp_wrapped_module).__name__ for m in (ours, ddp)],
        "is_ddp": isinstance(ours._dmp_wrapped_module, DistributedDataParallel),
        "losses": losses,
        "dense_diff": max(dense.values()),
        "threads": threads,
    }


# A fixed plan for the three tables at world size 2: t0's 8 columns as two shards of 4.
FIXED_PLAN = {
    "t0": {"sharding_type": "column_wise", "ranks": [1, 0]},
    "t1": {"sharding_type": "table_wise", "ranks": [1]},
    "t2": {"sharding_type": "data_parallel"},
}
INIT_SEED = 3


def _error(fn) -> str | None:
    """``"TypeName: message"`` of the ValueError ``fn()`` raises, or None."""
    try:
        fn()
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return None


def _tables(dmp) -> dict:
    return {k: v for k, v in gather_full_state_dict(dmp.state_dict()).items() if "embedding_bags" in k}


def shard_api_checks(rank: int, world_size: int) -> dict:
    """One spawn, several checks of ``recsys_dist.shard`` at this world size.

    Every size: the full tables right after ``shard(..., seed=INIT_SEED)`` (row_wise).
    Size 1: TorchRec's own init (init_tables=False); out-of-range ids refused on each call
    path, and under TrainPipelineSparseDist. Size 2: FIXED_PLAN honoured (plan, tables,
    forward), a rank outside the job refused, and the trainer's initial tables for the
    quickstart equal shard()'s.
    """
    import recsys_dist
    from recsys_dist.distributed.plan_io import plan_summary

    def meta_ebc():
        return EmbeddingBagCollection(tables=configs(), device=torch.device("meta"))

    out: dict = {}
    dmp = recsys_dist.shard(meta_ebc(), {"sharding_types": ["row_wise"]}, seed=INIT_SEED)
    out["tables"] = _tables(dmp)
    if world_size == 1:
        torchrec_init = recsys_dist.shard(meta_ebc(), {"sharding_types": ["row_wise"]}, init_tables=False)
        out["torchrec_init"] = _tables(torchrec_init)
        out.update(_id_checks(dmp))
    if world_size == 2:
        torch.manual_seed(0)
        ref = Tiny(EmbeddingBagCollection(tables=configs(), device=torch.device("cpu")))
        fixed = recsys_dist.shard(Tiny(meta_ebc()), {"fixed_plan": FIXED_PLAN}, seed=INIT_SEED)
        out["fixed_plan"] = {r["table"]: (r["sharding_type"], r["ranks"]) for r in plan_summary(fixed.plan)}
        out["fixed_tables"] = {k.removeprefix("sparse_arch."): v for k, v in _tables(fixed).items()}
        load_full_state_dict(fixed.state_dict(), ref.state_dict())
        batch = global_batch(0, world_size)[rank]
        got = fixed(batch.dense_features, batch.sparse_features)
        out["fixed_max_diff"] = (got - ref(batch.dense_features, batch.sparse_features)).abs().max().item()
        far = {**FIXED_PLAN, "t1": {"sharding_type": "table_wise", "ranks": [2]}}
        out["rank_outside"] = _error(lambda: recsys_dist.shard(Tiny(meta_ebc()), {"fixed_plan": far}))
        out["trainer_vs_shard"] = _trainer_vs_shard()
    return out


def _trainer_vs_shard() -> dict:
    """The quickstart model: the trainer's initial tables minus shard()'s, per table."""
    import recsys_dist
    from recsys_dist.config.loader import load_config
    from recsys_dist.distributed.env import init_distributed
    from recsys_dist.distributed.optim import fuse_embedding_optimizer
    from recsys_dist.train.build import build_task, shard_model
    from tests.conftest import QUICKSTART

    job = recsys_dist.resolve_job(load_config(QUICKSTART, [f"train.seed={INIT_SEED}"]))
    ctx = init_distributed(job.distributed)
    trainer, _, _ = shard_model(job, ctx)
    model = build_task(job, job.features.on(torch.device("meta"), ctx.device))
    fuse_embedding_optimizer(
        model, job.train.embedding_optimizer, job.train.embedding_lr, job.train.embedding_weight_decay
    )
    ours = recsys_dist.shard(model, job.sharding, device=ctx.device, seed=job.train.seed)
    want, got = _tables(trainer), _tables(ours)
    assert sorted(want) == sorted(got) and len(want) == 26, (sorted(want), sorted(got))
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


def _id_checks(ebc_dmp) -> dict:
    """Out-of-range ids through a bare EBC (``dmp(kjt)``), a model called with a keyword KJT,
    a CTRTask called with a batch, check_ids=False, a feature feeding two tables, and
    TrainPipelineSparseDist."""
    import recsys_dist

    def kjt(bad_key: str, bad_id: int) -> KeyedJaggedTensor:
        ids = {"f_t0": [5, 999], "f_t1": [7], "f_t2": [30]}
        ids[bad_key] = [*ids[bad_key], bad_id]
        return KeyedJaggedTensor(
            keys=list(ids),
            values=torch.tensor([i for v in ids.values() for i in v]),
            lengths=torch.tensor([len(ids["f_t0"]), 0, 0, len(ids["f_t1"]), len(ids["f_t2"]), 0]),
        )

    out = {
        "ebc_ok": _error(lambda: ebc_dmp(kjt("f_t0", 0))),
        "ebc_too_big": _error(lambda: ebc_dmp(kjt("f_t1", 50))),
        "ebc_negative": _error(lambda: ebc_dmp(kjt("f_t0", -1))),
    }
    meta = torch.device("meta")
    tiny = recsys_dist.shard(Tiny(EmbeddingBagCollection(tables=configs(), device=meta)))
    out["keyword"] = _error(lambda: tiny(torch.zeros(2, NUM_DENSE), kjt=kjt("f_t2", 31)))
    unchecked = recsys_dist.shard(EmbeddingBagCollection(tables=configs(), device=meta), check_ids=False)
    out["unchecked"] = _error(lambda: unchecked(kjt("f_t1", 50)))
    shared = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=50, feature_names=["f"]),
    ]
    two = recsys_dist.shard(EmbeddingBagCollection(tables=shared, device=meta))
    out["shared"] = _error(
        lambda: two(KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 70]), lengths=torch.tensor([1, 1])))
    )
    out["pipeline"] = _pipeline_with_bad_batch()
    return out


def _pipeline_with_bad_batch() -> dict:
    """TrainPipelineSparseDist over a shard()ed CTRTask: two good batches train, the third
    (an id of f_t1 = 50 rows) is refused."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    import recsys_dist

    model = CTRTask(Tiny(EmbeddingBagCollection(tables=configs(), device=torch.device("meta"))))
    dmp = recsys_dist.shard(model, {"sharding_types": ["table_wise", "data_parallel"]})
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    pipe = TrainPipelineSparseDist(dmp, torch.optim.SGD(dense, lr=0.1), torch.device("cpu"))
    batches = [global_batch(step, 1)[0] for step in range(4)]
    sf = batches[2].sparse_features
    values = sf.values().clone()
    first_t1 = sum(sf.length_per_key()[:1])
    values[first_t1] = 50  # f_t1's first id
    assert sf.length_per_key()[1] > 0
    batches[2] = CTRBatch(
        dense_features=batches[2].dense_features,
        sparse_features=KeyedJaggedTensor(keys=sf.keys(), values=values, lengths=sf.lengths(), stride=B),
        labels=batches[2].labels,
        weights=batches[2].weights,
    )
    it, losses = iter(batches), []
    try:
        for _ in range(4):
            losses.append(pipe.progress(it)[0].item())
    except ValueError as err:
        return {"losses": losses, "error": str(err)}
    return {"losses": losses, "error": None}
