"""``sharding.replica_groups`` against one group: one rank's side (run via run_ranks).

Both go through the trainer's sharding path (``recsys_dist.train.build.shard_model``) from one
seed and train the same per-rank batches (``dense_worker``'s: quickstart dlrm, dense Adam under
DDP); the replica-groups model syncs after each step as the Trainer's StepRunner does
(``replicas.stepped``). Compared: the losses, the ledger's sync bytes against the tensors
``sync()`` all-reduces, the unsharded weights, and checkpoints moved between the two layouts.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recsys_dist.checkpoint.dcp import global_bytes, load_checkpoint, save_checkpoint, set_optimizer_steps
from recsys_dist.checkpoint.gather import gather_full_state
from recsys_dist.checkpoint.loop import save_checkpoint as save_own
from recsys_dist.distributed import replicas
from recsys_dist.distributed.comm_counter import CommCounter
from recsys_dist.distributed.dense import local_dense_bytes
from recsys_dist.distributed.env import init_distributed
from recsys_dist.distributed.ledger import run_ledger
from recsys_dist.distributed.optim import init_lazy_state
from recsys_dist.distributed.tables import gather_full_state_dict
from recsys_dist.train.best_weights import MemoryCopy
from recsys_dist.train.build import shard_model
from recsys_dist.train.checkpointing import Checkpointer
from recsys_dist.train.observe import PhaseClock
from recsys_dist.train.steps import StepRunner
from recsys_dist.train.summary import ledger_line
from tests.ranks.distributed import pipeline_worker
from tests.ranks.distributed.dense_worker import B, _batch, _cfg, _state


def _build(types, optimizer: str, groups: int, world_size: int, every: int = 1, strategy: str = "ddp", more=()):
    extra = [f"train.embedding_optimizer={optimizer}", f"sharding.replica_groups={groups}", *more]
    if groups > 1:
        extra.append(f"sharding.replica_sync_every={every}")
    cfg = _cfg("dlrm", types, strategy, world_size, tuple(extra))
    ctx = init_distributed(cfg.distributed)
    torch.manual_seed(cfg.train.seed + ctx.rank)  # DDP starts every rank from rank 0's dense weights
    dmp, opt = shard_model(cfg, ctx)[:2]
    return cfg, ctx, dmp, opt


def _train(dmp, opt, steps: range, rank: int, world_size: int) -> list[float]:
    return train_on(dmp, opt, (_batch(step, rank, world_size) for step in steps))


def train_on(dmp, opt, batches) -> list[float]:
    """One plain step on each of ``batches`` (this rank's), the replicas' step count advanced as
    the Trainer does: this rank's losses."""
    losses = []
    for batch in batches:
        loss = dmp(batch)[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        replicas.stepped(dmp)  # the Trainer's StepRunner.after_step
        losses.append(loss.item())
    return losses


def _sync_payload(dmp) -> int:
    """Bytes this rank's ``sync()`` all-reduces: the tensors DMPCollection cached for it."""
    ctx = dmp._default_ctx
    tensors = [t for d in (ctx.weights_by_dtype, ctx.optimizer_tensors_by_dtype) for ts in d.values() for t in ts]
    return sum(t.numel() * t.element_size() for t in tensors)


def losses(rank: int, world_size: int, cases: list, steps: int, groups: int) -> dict:
    """Per case (sharding types, embedding optimizer, sync every): the losses of ``steps`` steps
    at one group and at ``groups`` groups; for the latter also the ledger (``run_ledger``) of
    this rank's group rank and the bytes its sync moves."""
    out: dict = {}
    for types, optimizer, every in cases:
        for g in (1, groups):
            if g == 1 and (tuple(types), optimizer, 1, 1) in out:
                continue
            cfg, ctx, dmp, opt = _build(types, optimizer, g, world_size, every)
            got = {"losses": _train(dmp, opt, range(steps), rank, world_size), "type": type(dmp).__name__}
            if g > 1:
                led = run_ledger(dmp, cfg.data, cfg.sharding.comms, B, world_size)
                group_rank = dist.get_rank(dmp._default_ctx.sharding_pg)
                got["ledger"] = {
                    "world_size": led.world_size,
                    "sync_bytes": led.sync_bytes[group_rank],
                    "replica_sync": led.per_rank()[group_rank]["replica_sync"]["sent"],
                    "output_dist_forward": led.per_rank()[group_rank]["output_dist_forward"]["sent"],
                }
                got["payload"] = _sync_payload(dmp)
                got["unsynced_after"] = dmp.steps_since_sync
            out[(tuple(types), optimizer, every if g > 1 else 1, g)] = got
    return out


def checkpoints(rank: int, world_size: int, run_dir: str, groups: int, steps: int, types=("row_wise",)) -> dict:
    """exact_sgd, ``types`` (default row_wise). ``ref``: one group trains 2 x ``steps`` steps, saving at ``steps``.
    ``replicas``: ``groups`` groups train ``steps`` (sync every 5 steps: none here; the first
    steps through the Trainer's StepRunner and sparse_dist pipeline), the StepRunner detaching (for a validation) one step before the end and its Checkpointer saving
    at the end, whether the replicas agree before and after each; its unsharded weights (two
    ways) then. ``to_one``: a
    fresh one-group model loads the replicas' checkpoint and trains steps .. 2 x steps;
    ``to_groups``: a fresh replica-groups model loads ``ref``'s and does the same."""
    types, out = list(types), {}
    root = Path(run_dir)
    _, ctx, dmp, opt = _build(types, "exact_sgd", 1, world_size)
    first = _train(dmp, opt, range(steps), rank, world_size)
    one_path = save_checkpoint(ctx, root / "one", steps, _state(dmp, opt), {"step": steps}, keep=5)
    one_bytes = global_bytes(ctx, _state(dmp, opt))
    out["ref"] = first + _train(dmp, opt, range(steps, 2 * steps), rank, world_size)
    del dmp, opt
    cfg, ctx, dmp, opt = _build(types, "exact_sgd", groups, world_size, every=5)
    # The first steps as the Trainer runs them: TorchRec's TrainPipelineSparseDist (train.pipeline
    # sparse_dist, whose own every-batch sync of a DMPCollection is off) and StepRunner.after_step.
    runner = StepRunner(dmp, opt, ctx.device, cfg.train)
    runner.start(0)
    batches = iter([_batch(step, rank, world_size) for step in range(steps - 1)])
    out["replicas"] = []
    for step in range(steps - 1):
        out["replicas"].append(runner.progress(batches, step)[0].item())
        runner.after_step()
    # The Trainer's scoring path (StepRunner.detach) and its saving path (Checkpointer.save) each
    # sync steps the cadence (every 5) has not: the replicas agree after either.
    out["agree_before_detach"] = _replicas_agree(dmp)
    runner.detach()
    opt.zero_grad()  # the pipeline zeroes the gradients before its backward, so its last ones are still there
    out["agree_after_detach"] = _replicas_agree(dmp)
    out["replicas"] += _train(dmp, opt, range(steps - 1, steps), rank, world_size)
    out["agree_before_save"] = _replicas_agree(dmp)
    saver = Checkpointer(root / "replicas", ctx, PhaseClock(time.time()), dmp, opt, in_memory_best=False)
    source = SimpleNamespace(loaders=SimpleNamespace(conversion=None, num_embeddings=[]), checkpoint_files=dict)
    rep_path = saver.save(steps, {"step": steps}, cfg, source)
    out["agree_after_save"] = _replicas_agree(dmp)
    # what the disk-space check expects against what DCP wrote, for both layouts
    out["bytes"] = {
        "replicas": (global_bytes(ctx, _state(dmp, opt)), _dir_bytes(rep_path)),
        "one": (one_bytes, _dir_bytes(one_path)),
    }
    full = gather_full_state(dmp.state_dict())  # publishing's path (rank 0 holds it)
    every = gather_full_state_dict(dmp.state_dict())  # tables.gather_full_state_dict (every rank)
    out["full_keys_equal"] = full is None or sorted(full) == sorted(every)
    out["full_max_diff"] = 0.0 if full is None else max((full[k] - every[k]).abs().max().item() for k in full)
    out["tables"] = {k: v for k, v in every.items() if "embedding_bags" in k}
    # restore_best with checkpoints off: a copy of this rank's shards, put back after a step
    best = MemoryCopy()
    best.keep(dmp, steps)
    _train(dmp, opt, range(steps, steps + 1), rank, world_size)
    best.restore(dmp)
    back = gather_full_state_dict(dmp.state_dict())
    out["memory_copy_diff"] = max((back[k] - every[k]).abs().max().item() for k in every)
    # your own loop's save (recsys_dist.save_checkpoint) syncs first too
    _train(dmp, opt, range(steps, steps + 1), rank, world_size)
    out["agree_before_own_save"] = _replicas_agree(dmp)
    save_own(root / "own", dmp, opt, step=steps + 1)
    out["agree_after_own_save"] = _replicas_agree(dmp)
    del dmp, opt
    for key, path, g in (("to_one", rep_path, 1), ("to_groups", one_path, groups)):
        torch.manual_seed(123)
        _, ctx, other, opt2 = _build(types, "exact_sgd", g, world_size)
        init_lazy_state(opt2, other.fused_optimizer)
        load_checkpoint(path, _state(other, opt2))
        set_optimizer_steps(opt2, steps)
        if key == "to_one":  # what it loaded, unsharded
            loaded = gather_full_state_dict(other.state_dict())
            out["tables_one"] = {k: v for k, v in loaded.items() if "embedding_bags" in k}
        out[key] = _train(other, opt2, range(steps, 2 * steps), rank, world_size)
        del other, opt2
    return out


def _replicas_agree(dmp) -> bool:
    """Whether this rank's table shards equal those of its replicas (the other groups' ranks
    holding the same shards). Collective."""
    pg = dmp.replica_pg
    mine = torch.cat([w.flatten() for ws in dmp._default_ctx.weights_by_dtype.values() for w in ws])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(every, mine, group=pg)
    same = torch.tensor([int(all(torch.equal(mine, x) for x in every))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*.distcp"))


# distributed.dense.strategy under replica groups: (strategy, groups) trained alike
DENSE_LAYOUTS = (("ddp", 1), ("fsdp", 1), ("fsdp", 0))  # 0: the run's replica groups
_DENSE_PHASES = ("allreduce", "fsdp_all_gather", "fsdp_reduce_scatter")


def dense_layouts(rank: int, world_size: int, run_dir: str, groups: int, steps: int) -> dict:
    """The dense tower under fsdp with ``groups`` replica groups, against one group under fsdp
    and ddp: exact_sgd row_wise tables (synced every step), ``steps`` steps of
    ``pipeline_worker``'s batches (the last rank's all padding at its PADDED_STEP). Per layout:
    this rank's losses, the dense weights after (whole), and the dense collectives of the last
    step ``counted`` (CommCounter) and ``predicted`` (the run's ledger, this rank's group row);
    each layout saves at ``steps // 2``. ``resumed``: (strategy, groups) -> the losses of steps
    ``steps // 2 ..`` of a fresh model of that layout loading the other layout's checkpoint
    (fsdp x groups <-> ddp x 1)."""
    half, out, paths = steps // 2, {}, {}
    for strategy, g in DENSE_LAYOUTS:
        g = g or groups
        cfg, ctx, dmp, opt = _build(["row_wise"], "exact_sgd", g, world_size, strategy=strategy)
        batches = [pipeline_worker._batch(step, rank, world_size) for step in range(steps)]
        got = {"type": type(dmp).__name__}
        if strategy == "ddp":  # every layout starts from these (rank 0's, broadcast)
            out["before"] = {n: _whole(p) for n, p in dmp.named_parameters() if "embedding" not in n}
        got["losses"] = train_on(dmp, opt, batches[:half])
        paths[(strategy, g)] = save_checkpoint(
            ctx, Path(run_dir) / f"{strategy}{g}", half, _state(dmp, opt), {}, keep=5
        )
        got["losses"] += train_on(dmp, opt, batches[half:-1])
        with CommCounter(dmp) as counter:
            got["losses"] += train_on(dmp, opt, batches[-1:])
        group_rank = dist.get_rank(dmp._default_ctx.sharding_pg) if g > 1 else rank
        predicted = run_ledger(dmp, cfg.data, cfg.sharding.comms, B, world_size).per_rank()[group_rank]
        got["counted"] = {p: dict(counter.counts[p]) for p in _DENSE_PHASES}
        got["predicted"] = {p: predicted[p] for p in _DENSE_PHASES}
        dense = {n: p for n, p in dmp.named_parameters() if "embedding" not in n}
        got["dense"] = {n: _whole(p) for n, p in dense.items()}
        got["dtensors"] = sum(isinstance(p, DTensor) for p in dense.values())
        got["dense_bytes"] = local_dense_bytes(dmp)["parameters"]
        out[(strategy, g)] = got
        del dmp, opt
    out["resumed"] = {}
    for (strategy, g), source in ((("ddp", 1), ("fsdp", groups)), (("fsdp", groups), ("ddp", 1))):
        torch.manual_seed(123)  # other initial weights: only the checkpoint can make them equal
        _, ctx, dmp, opt = _build(["row_wise"], "exact_sgd", g, world_size, strategy=strategy)
        init_lazy_state(opt, dmp.fused_optimizer)
        load_checkpoint(paths[source], _state(dmp, opt))
        set_optimizer_steps(opt, half)
        batches = [pipeline_worker._batch(step, rank, world_size) for step in range(half, steps)]
        out["resumed"][(strategy, g)] = train_on(dmp, opt, batches)
        del dmp, opt
    return out


CLIP = 1e-3  # train.dense_grad_clip_norm: below every step's dense gradient norm here, so each step clips


def clipped(rank: int, world_size: int, groups: int, steps: int) -> dict:
    """``train.dense_grad_clip_norm`` under fsdp (``GlobalNormClipping``, the norm reduced over
    the DTensors' mesh) in one group and in ``groups`` replica groups, on :func:`dense_layouts`'
    batches: (strategy, groups) -> this rank's losses, the dense weights after (whole) and the name
    of the dense optimizer's wrapper. (Clipped fsdp equals clipped ddp in one group at 1, 2 and 3
    ranks: tests/ranks/distributed/test_dense_fsdp.py.)"""
    out = {}
    for strategy, g in (("fsdp", 1), ("fsdp", groups)):
        more = [f"train.dense_grad_clip_norm={CLIP}"]
        _, _, dmp, opt = _build(["row_wise"], "exact_sgd", g, world_size, strategy=strategy, more=more)
        batches = [pipeline_worker._batch(step, rank, world_size) for step in range(steps)]
        losses = train_on(dmp, opt, batches)
        dense = {n: _whole(p) for n, p in dmp.named_parameters() if "embedding" not in n}
        out[(strategy, g)] = {"losses": losses, "dense": dense, "clipping": type(opt._optims[1][1]).__name__}
        del dmp, opt
    return out


def _whole(p: torch.Tensor) -> torch.Tensor:
    p = p.detach()
    return (p.full_tensor() if isinstance(p, DTensor) else p).clone()


def everything(rank: int, world_size: int, run_dir: str, cases: list, steps: int, groups: int) -> dict:
    """One spawn: :func:`losses` over ``cases``, :func:`dense_layouts`, :func:`pipeline_layouts`,
    :func:`clipped`, then :func:`checkpoints`."""
    return {
        "losses": losses(rank, world_size, cases, steps, groups),
        "dense": dense_layouts(rank, world_size, f"{run_dir}/dense", groups, steps),
        "pipeline": pipeline_layouts(rank, world_size, f"{run_dir}/pipeline", groups, steps),
        # groups of one rank (the 2-rank test): not checked there, so not run
        "clipped": clipped(rank, world_size, groups, steps) if world_size > groups else None,
        # table_wise: its DTensors read (Replicate(), Replicate()) though one rank of a group holds
        # the table, which DTensor.full_tensor() cannot gather (tables.full_tensor does)
        "checkpoints": {
            t: checkpoints(rank, world_size, f"{run_dir}/{t}", groups, steps // 2, (t,))
            for t in ("row_wise", "table_wise")
        },
    }


# distributed.dense.strategy: pipeline under replica groups: (strategy, groups, schedule) trained
# alike, plain SGD (pipeline_worker.SGD: Adam's normalised update magnifies float rounding)
PIPELINE_LAYOUTS = (("ddp", 1, None), ("pipeline", 1, "1f1b"), ("pipeline", 0, "1f1b"), ("pipeline", 0, "gpipe"))


def _build_pipe(strategy: str, g: int, schedule: str | None, world_size: int):
    extra = ["train.embedding_optimizer=exact_sgd", f"sharding.replica_groups={g}", f"train.batch_size={B}"]
    extra += pipeline_worker.SGD
    if strategy == "pipeline":
        extra += ["distributed.dense.stages=2", f"distributed.dense.schedule={schedule}"]
    cfg = _cfg("dlrm", ["row_wise"], strategy, world_size, tuple(extra))
    ctx = init_distributed(cfg.distributed)
    torch.manual_seed(cfg.train.seed + ctx.rank)  # every layout starts from rank 0's dense weights
    dmp, opt = shard_model(cfg, ctx)[:2]
    return cfg, ctx, dmp, opt


def _pipe_train(dmp, opt, batches, world_size: int, staged: bool, counter=None) -> list[float]:
    """:func:`pipeline_worker.train_on` with the replicas synced after each step, as the Trainer's
    StepRunner does; ``counter`` around the last step only."""
    return pipeline_worker.train_on(dmp, opt, batches, world_size, staged, after=replicas.stepped, counter=counter)


def _weights(dmp) -> tuple[dict, dict]:
    """(this rank's dense weights: its own stages' under pipeline; the whole tables, unsharded).
    Collective."""
    dense = {n: p.detach().clone() for n, p in dmp.named_parameters() if "embedding" not in n}
    tables = {k: v for k, v in gather_full_state_dict(dmp.state_dict()).items() if "embedding_bags" in k}
    return dense, tables


def pipeline_layouts(rank: int, world_size: int, run_dir: str, groups: int, steps: int) -> dict | None:
    """The dense tower under pipeline (2 stages) with ``groups`` replica groups, against one group
    under pipeline and ddp: exact_sgd row_wise tables synced every step, plain SGD on the tower,
    ``steps`` of ``pipeline_worker``'s batches (the last rank's all padding at PADDED_STEP). Per
    layout: the global losses; this rank's dense weights after (its own stages' under pipeline);
    under pipeline its pipeline rank and group's ranks, and the last step's pipeline collectives
    ``counted`` (pipeline_worker._Counted) and ``predicted`` (the run's ledger line, this rank's
    group row). ``resumed``: a checkpoint at ``steps // 2`` of pipeline x groups resumed under
    ddp x 1 and the reverse. None when a sharding group is smaller than 2 ranks."""
    if world_size // groups < 2:
        return None
    half, out, paths = steps // 2, {}, {}
    batches = [pipeline_worker._batch(step, rank, world_size) for step in range(steps)]
    for strategy, g, schedule in PIPELINE_LAYOUTS:
        g = g or groups
        cfg, ctx, dmp, opt = _build_pipe(strategy, g, schedule, world_size)
        staged, got = strategy == "pipeline", {"type": type(dmp).__name__}
        if strategy == "ddp":  # every layout starts from these (rank 0's dense weights, the seeded tables)
            out["before"] = _weights(dmp)
        got["losses"] = _pipe_train(dmp, opt, batches[:half], world_size, staged)
        if schedule != "gpipe":
            path = Path(run_dir) / f"{strategy}{g}"
            paths[(strategy, g)] = save_checkpoint(ctx, path, half, _state(dmp, opt), {}, keep=5)
        counter = pipeline_worker._Counted() if staged else None
        got["losses"] += _pipe_train(dmp, opt, batches[half:], world_size, staged, counter)
        got["dense"], got["tables"] = _weights(dmp)
        if staged:
            st = dmp.dense_stages
            got["index"], got["group"] = st.index, dist.get_process_group_ranks(st.group)
            group_rank = dist.get_rank(dmp._default_ctx.sharding_pg) if g > 1 else rank
            line = ledger_line(cfg, dmp, world_size)["per_rank"][group_rank]
            got["counted"] = {p: list(v) for p, v in counter.counts.items()}
            got["predicted"] = {p: [line[p]["sent"], line[p]["received"]] for p in counter.counts}
        out[(strategy, g, schedule)] = got
        del dmp, opt
    out["resumed"] = {}
    for (strategy, g, schedule), source in (
        (("ddp", 1, None), ("pipeline", groups)),
        (("pipeline", groups, "1f1b"), ("ddp", 1)),
    ):
        torch.manual_seed(123 + rank)  # other initial weights: only the checkpoint can make them equal
        _, ctx, dmp, opt = _build_pipe(strategy, g, schedule, world_size)
        init_lazy_state(opt, dmp.fused_optimizer)
        load_checkpoint(paths[source], _state(dmp, opt))
        set_optimizer_steps(opt, half)
        out["resumed"][(strategy, g)] = _pipe_train(dmp, opt, batches[half:], world_size, strategy == "pipeline")
        del dmp, opt
    return out
