"""``distributed.dense.schedule: 2bw`` against an independent reference: one rank's side.

The reference is a plain loop in one process on the unsharded model (``build_task``, the
sharded model's initial weights gathered into it) over the global batch (every rank's batch of
``pipeline_worker._batch``, padding step included), written from the paper's rule, not from the
code under test: the tower's gradient is taken at the previous weights through
``torch.func.functional_call`` with a copy of W(t-1), and applied to W(t) by torch's optimizer;
the tables (plain SGD) take the gradient of the same loss at once. ``delay=0`` is the synchronous
rule (what 1f1b and ddp train).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.func import functional_call

from recsys_dist.checkpoint.dcp import load_checkpoint, save_checkpoint, set_optimizer_steps
from recsys_dist.checkpoint.gather import gather_full_state
from recsys_dist.checkpoint.safe_read import checkpoint_keys
from recsys_dist.distributed.env import init_distributed
from recsys_dist.distributed.optim import init_lazy_state
from recsys_dist.distributed.tables import load_full_state_dict
from recsys_dist.distributed.two_bw import STALE_KEY, fit_to_checkpoint, stale_state
from recsys_dist.train.build import build_task, shard_model
from tests.ranks.distributed import dense_worker, pipeline_worker

OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


def _global_batch(step: int, world_size: int):
    """Every rank's batch of ``step`` as one batch, in rank order (one id per row and feature)."""
    parts = [pipeline_worker._batch(step, r, world_size) for r in range(world_size)]
    kjt = parts[0].sparse_features
    keys, b = kjt.keys(), dense_worker.B
    values = torch.cat([p.sparse_features.values().view(len(keys), b) for p in parts], dim=1).reshape(-1)
    sparse = type(kjt)(keys=keys, values=values, lengths=torch.ones_like(values, dtype=torch.int32))
    cat = lambda f: torch.cat([getattr(p, f) for p in parts])  # noqa: E731
    return cat("dense_features"), sparse, cat("labels"), cat("weights")


def reference_losses(ref, steps: int, world_size: int, delay: int, table_lr: float, dense: tuple) -> list[float]:
    """The global loss of each step of W(t+1) = W(t) - lr * grad f(W(t - delay)) on the tower
    (``dense``: optimizer name, lr), the tables' SGD at ``table_lr`` undelayed."""
    named = dict(ref.model.named_parameters())
    tables = {n: p for n, p in named.items() if "embedding_bags." in n}
    tower = {n: p for n, p in named.items() if n not in tables}
    opt_tables = torch.optim.SGD(tables.values(), lr=table_lr)
    opt_tower = OPTIMIZERS[dense[0]](tower.values(), lr=dense[1])
    previous = {n: p.detach().clone() for n, p in tower.items()}  # W(-1) = W(0)
    losses = []
    for step in range(steps):
        dense_x, sparse, labels, weights = _global_batch(step, world_size)
        used = {n: previous[n].clone().requires_grad_() for n in tower} if delay else tower
        logits = functional_call(ref.model, {**tables, **used}, (dense_x, sparse))
        loss = ref.loss(logits.squeeze(-1).float(), labels, weights)
        loss.backward()
        if delay:
            for n, p in tower.items():
                p.grad = used[n].grad
            previous = {n: p.detach().clone() for n, p in tower.items()}  # W(t): the next step's
        opt_tables.step()
        opt_tower.step()
        opt_tables.zero_grad()
        opt_tower.zero_grad()
        losses.append(loss.item())
    return losses


def _dense_overrides(dense: tuple) -> tuple:
    return (f"train.dense_optimizer={dense[0]}", f"train.dense_lr={dense[1]}")


def against_reference(rank: int, world_size: int, cases: list, steps: int) -> dict:
    """Per case ``(model, sharding types, pipeline overrides, (dense optimizer, lr))``, tables
    on plain SGD: the global losses of ``steps`` steps of 2bw and of 1f1b through the Trainer's
    step, and (rank 0) the reference's with and without the delay; the parameter bytes of this
    rank's stage and of its W(t-1)."""
    out: dict = {}
    for name, types, extra, dense in cases:
        got: dict = {}
        for schedule in ("2bw", "1f1b"):
            more = (*extra, f"distributed.dense.schedule={schedule}", *_dense_overrides(dense))
            cfg = pipeline_worker._cfg(name, types, "pipeline", world_size, more, sgd=True)
            ctx = init_distributed(cfg.distributed)
            dmp, opt = dense_worker._build(cfg, ctx)
            if schedule == "2bw":
                full = gather_full_state(dmp.state_dict())  # on rank 0: every rank's stages, whole
                ref = build_task(cfg, cfg.features.on(torch.device("cpu"), torch.device("cpu"))) if rank == 0 else None
                if ref is not None:
                    load_full_state_dict(ref.state_dict(), full)
                stale = stale_state(dmp)[STALE_KEY]
                st = dmp.dense_stages
                own = [p for m in st.modules_of(st.index) for p in m.parameters()]
                got["bytes"] = {
                    "stage": sum(p.numel() * p.element_size() for p in own),
                    "stale": sum(t.numel() * t.element_size() for t in stale.values()),
                }
            got[schedule] = pipeline_worker._train(dmp, opt, range(steps), rank, world_size, staged=True)
        if rank == 0:
            table_lr = float(cfg.train.embedding_lr)
            got["ref_2bw"] = reference_losses(ref, steps, world_size, 1, table_lr, dense)
            load_full_state_dict(ref.state_dict(), full)
            got["ref_sync"] = reference_losses(ref, steps, world_size, 0, table_lr, dense)
        out[(name, tuple(types), tuple(extra), dense)] = got
    return out


def _cfg(schedule: str | None, world_size: int):
    """dcnv2, tables row- and table-wise on row-wise Adagrad, the tower on Adam (their state moves
    with the checkpoint); ``schedule`` None: ddp."""
    strategy = "ddp" if schedule is None else "pipeline"
    extra = () if schedule is None else (f"distributed.dense.schedule={schedule}",)
    return pipeline_worker._cfg("dcnv2", ["row_wise", "table_wise"], strategy, world_size, extra)


def _state(dmp, opt) -> dict:
    return {**pipeline_worker._state(dmp, opt), **stale_state(dmp)}


def _load(cfg, ctx, path, steps: int, with_stale: bool = True):
    torch.manual_seed(123 + dist.get_rank())  # other initial dense weights: only the checkpoint can make them equal
    dmp, opt = shard_model(cfg, ctx)[:2]
    init_lazy_state(opt, dmp.fused_optimizer)
    state = _state(dmp, opt)
    keys = checkpoint_keys(path)
    fit_to_checkpoint(dmp, state, keys if with_stale else {k for k in keys if not k.startswith(STALE_KEY)})
    load_checkpoint(path, state)
    set_optimizer_steps(opt, steps)
    return dmp, opt


def resume(rank: int, world_size: int, run_dir: str, steps: int) -> dict:
    """A 2bw run and a ddp run, each saved after ``steps`` steps (as the Trainer's checkpointer:
    the replicas synced first) and trained ``steps`` more (``want_2bw``, ``want_ddp``). Fresh
    models (other initial weights) then load a checkpoint and train the same ``steps`` batches:
    2bw from the 2bw one (``2bw<-2bw``), from it without W(t-1) (``2bw<-2bw-nostale``), from the
    ddp one (``2bw<-ddp``); ddp from the 2bw one (``ddp<-2bw``). ``weights``: the largest
    difference between the 2bw run's weights at its save (every rank's copy) and those ddp
    loaded from its checkpoint."""
    out: dict = {}
    paths = {}
    saved = None
    for schedule in ("2bw", None):
        cfg = _cfg(schedule, world_size)
        ctx = init_distributed(cfg.distributed)
        dmp, opt = dense_worker._build(cfg, ctx)
        staged = schedule is not None
        pipeline_worker._train(dmp, opt, range(steps), rank, world_size, staged)
        if staged:
            saved = pipeline_worker._weights(dmp)
        sub = f"{run_dir}/{schedule or 'ddp'}"
        paths[schedule] = save_checkpoint(ctx, sub, steps, _state(dmp, opt), {"step": steps}, keep=5)
        out[f"want_{schedule or 'ddp'}"] = pipeline_worker._train(
            dmp, opt, range(steps, 2 * steps), rank, world_size, staged
        )
    runs = (
        ("2bw<-2bw", "2bw", "2bw", True),
        ("2bw<-2bw-nostale", "2bw", "2bw", False),
        ("2bw<-ddp", "2bw", None, True),
    )
    for key, schedule, source, with_stale in (*runs, ("ddp<-2bw", None, "2bw", True)):
        cfg = _cfg(schedule, world_size)
        ctx = init_distributed(cfg.distributed)
        dmp, opt = _load(cfg, ctx, paths[source], steps, with_stale)
        if key == "ddp<-2bw":
            loaded = pipeline_worker._weights(dmp)
            out["weights"] = max(float((loaded[k] - saved[k]).abs().max()) for k in saved)
        out[key] = pipeline_worker._train(dmp, opt, range(steps, 2 * steps), rank, world_size, schedule is not None)
    return out
