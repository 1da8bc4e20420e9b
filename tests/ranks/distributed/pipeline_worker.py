"""``distributed.dense.strategy: pipeline`` against ``ddp``: one rank's side (run via run_ranks).

Both strategies go through the trainer's sharding path (``shard_model``) from the same seed and
train on the same per-rank batches (one step where the last rank's batch is padding only, with
the loss scale the loader would set); ddp steps as the task's forward / backward, pipeline through
the Trainer's step (``StagePipeline``). Compared: the global loss of every step, and every weight
(dense tower after the replicas' sync, this rank's table shards) after the last step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_dist.checkpoint.dcp import canonical_optimizer_state, load_checkpoint, save_checkpoint, set_optimizer_steps
from recsys_dist.distributed.env import init_distributed
from recsys_dist.distributed.optim import init_lazy_state
from recsys_dist.train.build import shard_model
from recsys_dist.train.stage_pipeline import StagePipeline
from tests.ranks.distributed import dense_worker

PADDED_STEP = 3  # the last rank's batch is padding only at this step


def _batch(step: int, rank: int, world_size: int):
    batch = dense_worker._batch(step, rank, world_size)
    weights = torch.ones(dense_worker.B)
    if step == PADDED_STEP and rank == world_size - 1:
        weights = torch.zeros(dense_worker.B)
    total = dense_worker.B * (world_size - (1 if step == PADDED_STEP else 0))
    batch.weights = weights
    batch.loss_scale = torch.tensor(float(weights.sum()) * world_size / total)
    return batch


# Plain SGD: an update off by a constant factor shows (Adagrad's and Adam's normalised updates
# would hide it), and float rounding is not magnified (Adam divides a near-zero gradient by its
# near-zero root mean square: measured, 1e-7 differences became 1e-4 in the loss in 10 steps).
SGD = (
    "train.embedding_optimizer=exact_sgd",
    "train.embedding_lr=0.5",
    "train.dense_optimizer=sgd",
    "train.dense_lr=0.1",
)


def _cfg(name: str, types: list[str], strategy: str, world_size: int, extra: tuple = (), sgd: bool = False):
    stages = (
        []
        if any(e.startswith("distributed.dense.stages=") for e in extra)
        else [f"distributed.dense.stages={world_size}"]
    )
    pipe = [*stages, *extra] if strategy == "pipeline" else []
    return dense_worker._cfg(name, types, strategy, world_size, (*(SGD if sgd else ()), *pipe))


def _train(dmp, opt, steps: range, rank: int, world_size: int, staged: bool, own: list | None = None) -> list[float]:
    """Global losses (ddp: the ranks' mean, as the train log); ``own``: this rank's losses (what
    its ``on_step_end`` gets) appended."""
    return train_on(dmp, opt, (_batch(step, rank, world_size) for step in steps), world_size, staged, own)


def train_on(
    dmp, opt, batches, world_size: int, staged: bool, own: list | None = None, after=None, counter=None
) -> list[float]:
    """One step on each of ``batches`` (this rank's), through ``StagePipeline`` if ``staged``
    else a plain DMP step: the global losses (the ranks' mean); ``own``: this rank's appended.
    ``after(dmp)`` runs after each step (the replicas' sync: ``replicas.stepped``); ``counter``
    (a context, e.g. :class:`_Counted`) is entered around the last batch's step only."""
    runner = StagePipeline(dmp, opt, torch.device("cpu")) if staged else None
    losses = []
    batches = list(batches) if counter is not None else batches
    last = len(batches) - 1 if counter is not None else -1
    for i, batch in enumerate(batches):
        with counter if i == last else contextlib.nullcontext():
            if staged:
                loss = runner.progress(iter([batch]))[0].clone()
            else:
                loss = dmp(batch)[0]
                loss.backward()
                opt.step()
                opt.zero_grad()
                loss = loss.detach().clone()
        if after is not None:
            after(dmp)
        if own is not None:
            own.append(loss.item())
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return losses


def _weights(dmp) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            for i, shard in enumerate(v.local_shards()):
                out[f"{k}#{i}"] = shard.tensor.detach().clone()
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
    return out


def losses_and_weights(rank: int, world_size: int, cases: list, steps: int) -> dict:
    """Per case ``(model name, sharding types, pipeline overrides)``, plain SGD: ddp's and
    pipeline's global losses of ``steps`` steps and the weight differences after them."""
    out: dict = {}
    for name, types, extra in cases:
        got = {}
        for strategy in ("ddp", "pipeline"):
            cfg = _cfg(name, types, strategy, world_size, extra, sgd=True)
            ctx = init_distributed(cfg.distributed)
            dmp, opt = dense_worker._build(cfg, ctx)
            first = _weights(dmp)
            own: list[float] = []
            losses = _train(dmp, opt, range(steps), rank, world_size, strategy == "pipeline", own)
            with torch.no_grad():  # a scoring pass (evaluate, predict): the model's forward, every stage
                dmp.eval()
                scores = dmp(_batch(PADDED_STEP, rank, world_size))[1][1]
                dmp.train()
            got[strategy] = (losses, _weights(dmp), getattr(dmp, "dense_stages", None), scores)
            got[f"{strategy}_own"] = own
        ref, pipe = got["ddp"][1], got["pipeline"][1]
        assert pipe.keys() <= ref.keys()  # a pipeline rank holds its own stages' dense weights only
        stages = got["pipeline"][2]
        out[(name, tuple(types), tuple(extra))] = {
            "ddp": got["ddp"][0],
            "pipeline": got["pipeline"][0],
            "ddp_own": got["ddp_own"],
            "pipeline_own": got["pipeline_own"],
            # tables (sharded or replicated) and the dense tower (this rank's stages)
            "table_diff": max(float((ref[k] - pipe[k]).abs().max()) for k in ref if "embedding" in k),
            # per dense tensor: |ddp - pipeline| / |ddp's update over the steps| (Frobenius norms)
            "dense_rel": max(
                float((ref[k] - pipe[k]).norm() / (ref[k] - first[k]).norm().clamp_min(1e-12))
                for k in pipe
                if "embedding" not in k
            ),
            # this rank's logits of a scoring pass (the last rank's batch all padding), against ddp's
            "score_diff": float((got["ddp"][3] - got["pipeline"][3]).abs().max()),
            "dense_keys": sorted(k for k in pipe if "embedding" not in k),
            "ddp_dense_keys": sorted(k for k in ref if "embedding" not in k),
            "starts": stages.starts,
            "own_params": sum(p.numel() for m in stages.own_modules() for p in m.parameters()),
            "owned": stages.owned,
        }
    return out


def _state(dmp, opt) -> dict:
    return {"model": dmp.state_dict(), "optimizer": canonical_optimizer_state(opt.state_dict())}


def resume_across(
    rank: int, world_size: int, run_dir: str, first: str, then: str, steps: int, schedules: list[tuple]
) -> list[dict]:
    """Dense Adam (its state moves with the checkpoint), tables' row-wise Adagrad. Per entry of
    ``schedules`` (the pipeline side's overrides): train ``steps`` under ``first`` (sync, save
    as the Trainer's checkpointer does), ``steps`` more (``want``); a fresh model under ``then``
    (other initial weights) loads the checkpoint and trains the same batches (``got``);
    ``fresh``: the same without the load."""
    return [
        _resume_once(rank, world_size, f"{run_dir}/{i}", first, then, steps, extra) for i, extra in enumerate(schedules)
    ]


def _resume_once(rank: int, world_size: int, run_dir: str, first: str, then: str, steps: int, extra: tuple) -> dict:
    types = ["row_wise", "table_wise"]
    cfg = _cfg("dcnv2", types, first, world_size, extra)
    ctx = init_distributed(cfg.distributed)
    dmp, opt = dense_worker._build(cfg, ctx)
    _train(dmp, opt, range(steps), rank, world_size, first == "pipeline")
    path = save_checkpoint(ctx, run_dir, steps, _state(dmp, opt), {"step": steps}, keep=5)
    want = _train(dmp, opt, range(steps, 2 * steps), rank, world_size, first == "pipeline")
    cfg2 = _cfg("dcnv2", types, then, world_size, extra)
    out = {"want": want}
    for key, load in (("got", True), ("fresh", False)):
        torch.manual_seed(123 + rank)  # other initial dense weights: only the checkpoint can make them equal
        other, opt2 = shard_model(cfg2, ctx)[:2]
        if load:
            init_lazy_state(opt2, other.fused_optimizer)
            load_checkpoint(path, _state(other, opt2))
            set_optimizer_steps(opt2, steps)
        out[key] = _train(other, opt2, range(steps, 2 * steps), rank, world_size, then == "pipeline")
    return out


class Tower(torch.nn.Module):
    """A user's cuttable model: ``[l1, l2, head]`` after the pooled embeddings."""

    def __init__(self, spec, hidden: int = 8):
        import torchrec

        super().__init__()
        self.ebc = torchrec.EmbeddingBagCollection(tables=spec.tables, device=spec.embedding_device)
        self.feats = list(spec.sparse_names)
        width = spec.num_dense + len(spec.tables) * spec.embedding_dim
        self.l1 = torch.nn.Linear(width, hidden, device=spec.device)
        self.l2 = torch.nn.Linear(hidden, hidden, device=spec.device)
        self.head = torch.nn.Linear(hidden, 1, device=spec.device)

    def pipeline_input(self, dense, kjt):
        pooled = self.ebc(kjt)
        return torch.cat([dense, *(pooled[f] for f in self.feats)], dim=1)

    def pipeline_tower(self):
        return [self.l1, self.l2, self.head]

    def forward(self, dense, kjt):
        x = self.pipeline_input(dense, kjt)
        for m in self.pipeline_tower():
            x = m(x)
        return x


class InputUsesTower(Tower):
    """Its pipeline_input uses a parameter of the tower's second module (stage 1's): measured
    through ``recsys-dist train``, losses 2.7e-3 apart from ddp's by step 10, exit 0."""

    def pipeline_input(self, dense, kjt):
        return super().pipeline_input(dense, kjt) + 0.1 * self.l2.weight.sum()


def input_uses_the_tower(rank: int, world_size: int) -> dict:
    """Two steps of each model under pipeline (split at 1): the error of each, or None."""
    out = {}
    for model in ("Tower", "InputUsesTower"):
        cfg = _cfg(f"{__name__}:{model}", ["table_wise"], "pipeline", world_size, ("distributed.dense.split=[1]",))
        ctx = init_distributed(cfg.distributed)
        dmp, opt = dense_worker._build(cfg, ctx)
        try:
            out[model] = _train(dmp, opt, range(2), rank, world_size, staged=True)
        except ValueError as err:
            out[model] = str(err)
    return out


class _Counted:
    """Bytes this rank sends and receives in the pipeline step's own collectives (patched on
    ``torch.distributed`` while entered) and in torch.distributed.pipelining's send / recv (its
    ``_batch_p2p``), booked as :mod:`recsys_dist.distributed.pipeline_traffic` books them."""

    def __init__(self) -> None:
        self.counts = {k: [0, 0] for k in ("pipeline_io", "pipeline_p2p", "allreduce")}

    def _add(self, phase: str, sent: int, received: int) -> None:
        self.counts[phase][0] += sent
        self.counts[phase][1] += received

    def __enter__(self):
        import sys

        from torch.distributed.pipelining import schedules

        self._saved = {n: getattr(dist, n) for n in ("all_gather", "gather", "scatter", "broadcast", "all_reduce")}
        self._p2p = schedules._batch_p2p
        orig, me = self._saved, self

        def size(group) -> int:
            return dist.get_world_size(group)

        def nbytes(t) -> int:
            return t.numel() * t.element_size()

        def all_gather(out, t, group=None, **kw):
            me._add("pipeline_io", (size(group) - 1) * nbytes(t), (size(group) - 1) * nbytes(t))
            return orig["all_gather"](out, t, group=group, **kw)

        def gather(t, parts=None, dst=None, group=None, **kw):
            root = dist.get_rank() == dst
            me._add("pipeline_io", 0 if root else nbytes(t), (size(group) - 1) * nbytes(t) if root else 0)
            return orig["gather"](t, parts, dst=dst, group=group, **kw)

        def scatter(t, chunks=None, src=None, group=None, **kw):
            root = dist.get_rank() == src
            me._add("pipeline_io", (size(group) - 1) * nbytes(t) if root else 0, 0 if root else nbytes(t))
            return orig["scatter"](t, chunks, src=src, group=group, **kw)

        def broadcast(t, src=None, group=None, **kw):
            root = dist.get_rank() == src
            me._add("pipeline_io", (size(group) - 1) * nbytes(t) if root else 0, 0 if root else nbytes(t))
            return orig["broadcast"](t, src=src, group=group, **kw)

        def all_reduce(t, *a, group=None, **kw):
            caller = sys._getframe(1).f_code.co_name  # _global_weight: the batch weight; _average: gradients
            me._add("pipeline_io" if caller == "_global_weight" else "allreduce", nbytes(t), nbytes(t))
            return orig["all_reduce"](t, *a, group=group, **kw)

        def batch_p2p(ops, desc=None):
            for op in ops:
                b = nbytes(op.tensor)
                me._add("pipeline_p2p", b if op.op is dist.isend else 0, 0 if op.op is dist.isend else b)
            return me._p2p(ops, desc=desc)

        for n, f in (("all_gather", all_gather), ("gather", gather), ("scatter", scatter)):
            setattr(dist, n, f)
        dist.broadcast, dist.all_reduce, schedules._batch_p2p = broadcast, all_reduce, batch_p2p
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.pipelining import schedules

        for n, f in self._saved.items():
            setattr(dist, n, f)
        schedules._batch_p2p = self._p2p


def counted_bytes(rank: int, world_size: int, cases: list) -> dict:
    """Per case ``(model name, pipeline overrides)``, table_wise tables: one step (the first:
    torch's one-off shape exchange), then the bytes of the second counted on this rank, and
    those :func:`recsys_dist.distributed.pipeline_traffic.add_pipeline_flows` predicts for it."""
    from recsys_dist.distributed.ledger import Ledger
    from recsys_dist.distributed.pipeline_traffic import add_pipeline_flows, pipeline_layout
    from recsys_dist.models.build import build_model

    out = {}
    for name, extra in cases:
        cfg = _cfg(name, ["table_wise"], "pipeline", world_size, extra)
        ctx = init_distributed(cfg.distributed)
        dmp, opt = dense_worker._build(cfg, ctx)
        runner = StagePipeline(dmp, opt, torch.device("cpu"))
        runner.progress(iter([_batch(0, rank, world_size)]))
        with _Counted() as counter:
            runner.progress(iter([_batch(1, rank, world_size)]))
        model = build_model(cfg.model, cfg.features.on(torch.device("meta")), cfg.train)
        layout, why = pipeline_layout(
            model, cfg.distributed.dense, world_size, cfg.features.num_dense, cfg.features.keys
        )
        led = Ledger(world_size, dense_worker.B, {})
        add_pipeline_flows(led, layout)
        want = {k: [0, 0] for k in counter.counts}
        for f in led.flows:
            if f.rank == rank:
                want[f.phase][0] += f.sent
                want[f.phase][1] += f.received
        out[(name, extra)] = {"counted": counter.counts, "predicted": want, "held": held_bytes(dmp, opt)}
    return out


def held_bytes(dmp, opt) -> dict[str, int]:
    """This rank's dense bytes now: ``parameters`` (every dense tensor the model holds, plus
    2bw's previous weights), ``gradients`` (those with one) and ``optimizer`` (the dense
    optimizer's tensor state), as ``recsys-dist plan`` counts them per rank."""
    from recsys_dist.distributed.dense import dense_parameters, local_dense_bytes, optimizer_state_bytes
    from recsys_dist.distributed.optim import dense_torch_optimizer
    from recsys_dist.distributed.two_bw import two_bw_of

    out = local_dense_bytes(dmp)
    out["optimizer"] = optimizer_state_bytes(dense_torch_optimizer(opt), dense_parameters(dmp))
    two_bw = two_bw_of(dmp)
    out["parameters"] += sum(t.numel() * t.element_size() for t in two_bw.stale) if two_bw else 0
    return out
