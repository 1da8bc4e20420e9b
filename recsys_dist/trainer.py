"""The training job one rank runs: data, sharded model, pipelined loop, evaluation.

Hybrid parallelism: embedding tables are sharded by TorchRec's planner and
DistributedModelParallel (DMP); the dense tower is data-parallel (DDP inside DMP).
``TrainPipelineSparseDist`` overlaps the input_dist all-to-all of batch i+1 with the
forward/backward of batch i.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer

from recsys_dist import sharding
from recsys_dist.checkpoint import save_checkpoint
from recsys_dist.config import RunConfig, save_config
from recsys_dist.data.criteo import DENSE_NAMES, SPARSE_NAMES, prepare_criteo
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.distributed import DistContext, broadcast_result, init_distributed
from recsys_dist.metrics import StreamingBinaryMetrics, binary_metrics, gather_predictions
from recsys_dist.observe import StepTimer, TraceWriter
from recsys_dist.models import build_model, embedding_configs
from recsys_dist.models.build import table_sizes
from recsys_dist.state import init_tables
from recsys_dist.optim import build_optimizer, fuse_embedding_optimizer

log = logging.getLogger("recsys_dist")

@dataclass
class Loaders:
    train: ParquetBatchLoader
    validation: ParquetBatchLoader
    test: ParquetBatchLoader


def make_loaders(cfg: RunConfig, ctx: DistContext) -> Loaders:
    """Convert the raw data once (rank 0) and open every split on every rank."""
    d = cfg.data
    prepared = broadcast_result(
        ctx, lambda: prepare_criteo(d.raw_path, d.num_embeddings, d.split, d.num_rows, d.cache_dir)
    )
    sizes = table_sizes(cfg)
    common = dict(rank=ctx.rank, world_size=ctx.world_size, dense_names=DENSE_NAMES, sparse_names=SPARSE_NAMES,
                  num_embeddings=sizes, pin_memory=ctx.device.type == "cuda")
    eval_bs = cfg.eval.batch_size or cfg.train.batch_size
    return Loaders(
        train=ParquetBatchLoader(str(prepared.files["train"]), cfg.train.batch_size, shuffle=d.shuffle,
                                 seed=cfg.train.seed, remainder=d.remainder, **common),
        validation=ParquetBatchLoader(str(prepared.files["validation"]), eval_bs, remainder="pad", **common),
        test=ParquetBatchLoader(str(prepared.files["test"]), eval_bs, remainder="pad", **common),
    )


def shard_model(cfg: RunConfig, ctx: DistContext) -> tuple[DistributedModelParallel, CombinedOptimizer, str]:
    """Build on meta, fuse the embedding optimizer into backward, plan, wrap in DMP."""
    model = build_model(cfg, ctx.device)
    fuse_embedding_optimizer(model.model.sparse_arch, cfg)
    tables = embedding_configs(cfg)
    plan = sharding.collective_plan(cfg, model, tables, ctx.device, dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=ctx.device, plan=plan, sharders=sharding.sharders())
    init_tables(dmp.state_dict(), tables, cfg.train.seed,
                {t.name: t.weight_init_max for t in tables})
    t = cfg.train
    optimizer = build_optimizer(dmp, t.embedding_optimizer, t.embedding_lr, t.dense_optimizer, t.dense_lr)
    return dmp, optimizer, str(plan)


@torch.no_grad()
def evaluate(dmp: nn.Module, loader: ParquetBatchLoader, device: torch.device, auc_buckets: int | None = None) -> dict:
    """Metrics over every rank's predictions on one split (padding excluded).

    ``auc_buckets`` None: exact, gathers every prediction; N: streaming histogram metrics in
    memory independent of the split's size (``auc_error_bound`` is reported). Every rank
    must call this, since both paths end in a collective.
    """
    was_training = dmp.training
    dmp.eval()
    stream = StreamingBinaryMetrics(auc_buckets, device=device) if auc_buckets else None
    logits, labels, weights = [], [], []
    for batch in loader:
        _, (_, lg, lb, w) = dmp(batch.to(device))
        if stream is not None:
            stream.update(lg, lb, w)
        else:
            logits.append(lg), labels.append(lb), weights.append(w)
    dmp.train(was_training)
    if stream is not None:
        return stream.merge().compute()
    if not logits:
        return {}
    all_logits, all_labels = gather_predictions(torch.cat(logits), torch.cat(labels), torch.cat(weights))
    return binary_metrics(all_logits, all_labels)


class MetricsWriter:
    """Rank 0 appends one JSON object per line to ``metrics.jsonl``, and mirrors every
    number to TensorBoard (``RUN_DIR/tensorboard``) when the ``tensorboard`` package is
    installed (``pip install recsys_dist[tensorboard]``)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(path.parent / "tensorboard"))
            except ImportError:
                pass

    def write(self, **record) -> None:
        if not self.enabled:
            return
        record = finite_or_none(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])
            self.tb.flush()


def finite_or_none(tree):
    """NaN / inf -> None, so the files stay strict JSON (AUC is undefined on one class)."""
    if isinstance(tree, dict):
        return {k: finite_or_none(v) for k, v in tree.items()}
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def train(cfg: RunConfig, run_dir: Path, profile_dir: Path | None = None) -> dict:
    """Train and evaluate as configured; returns the summary (also in summary.json).

    ``profile_dir``: write a torch.profiler trace of a few steps per rank there.
    """
    ctx = init_distributed(cfg)
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    run_dir = Path(run_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    loaders = make_loaders(cfg, ctx)
    log.info("data ready: %d train / %d validation / %d test rows, %d steps per epoch",
             loaders.train.num_rows, loaders.validation.num_rows, loaders.test.num_rows, len(loaders.train))
    dmp, optimizer, plan_text = shard_model(cfg, ctx)
    log.info("sharded: %s", ", ".join(sorted({r["sharding_type"] for r in sharding.plan_summary(dmp.plan)})))
    if ctx.is_main:
        (run_dir / "plan.txt").write_text(plan_text + "\n")
        (run_dir / "plan.json").write_text(json.dumps(sharding.plan_summary(dmp.plan), indent=2))
    loop = _Loop(cfg, ctx, dmp, optimizer, loaders, MetricsWriter(run_dir / "metrics.jsonl", ctx.is_main),
                 TraceWriter(profile_dir, ctx.rank))
    last_val = loop.run()
    test = evaluate(dmp, loaders.test, ctx.device, cfg.eval.auc_buckets)
    loop.writer.write(split="test", step=loop.step, epoch=loop.epoch, **test)
    summary = {
        "run_dir": str(run_dir),
        "world_size": ctx.world_size,
        "steps": loop.step,
        "rows_trained": loop.rows_trained,
        "train_seconds": round(loop.train_seconds, 3),
        "samples_per_s": round(loop.rows_trained / loop.train_seconds, 1) if loop.train_seconds > 0 else None,
        "validation": {k: last_val.get(k) for k in ("auc", "logloss", "ne")},
        "test": {k: test.get(k) for k in ("auc", "logloss", "ne")},
    }
    if cfg.checkpoint.enabled:
        state = {"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}
        meta = {"step": loop.step, "epoch": loop.epoch, "world_size": ctx.world_size,
                "plan": sharding.plan_summary(dmp.plan), "config": cfg.to_dict()}
        summary["checkpoint"] = str(save_checkpoint(ctx, run_dir, loop.step, state, meta))
    if ctx.is_main:
        (run_dir / "summary.json").write_text(json.dumps(finite_or_none(summary), indent=2))
    # Every rank leaves its last collective before any rank tears down gloo; a rank that
    # exited while a peer still had work queued made the peer abort (seen 1 run in 8).
    dist.barrier()
    dist.destroy_process_group()
    return finite_or_none(summary)


class _Loop:
    """The epoch / step loop around ``TrainPipelineSparseDist.progress`` and its logging."""

    def __init__(self, cfg, ctx, dmp, optimizer, loaders, writer, tracer) -> None:
        self.cfg, self.ctx, self.dmp, self.optimizer, self.loaders = cfg, ctx, dmp, optimizer, loaders
        self.writer, self.tracer, self.timer = writer, tracer, StepTimer(cfg.train.timing_every_n_steps)
        self.step = self.epoch = self.rows_trained = 0
        self.train_seconds = 0.0
        self.losses: list = []
        self.real_rows: list = []
        self.t0 = time.perf_counter()
        total = cfg.train.epochs * len(loaders.train)
        self.total_steps = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
        self.bar = tqdm(total=self.total_steps, desc="train", unit="step", dynamic_ncols=True, leave=False,
                        disable=not (ctx.is_main and cfg.train.progress_bar))

    def done(self) -> bool:
        return self.step >= self.total_steps

    def run(self) -> dict:
        last_val: dict = {}
        for self.epoch in range(self.cfg.train.epochs):
            if self.done():
                break
            last_val = self.run_epoch() or last_val
        self.tracer.close()
        self.bar.close()
        return last_val

    def run_epoch(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        pipe = TrainPipelineSparseDist(self.dmp, self.optimizer, ctx.device, execute_all_batches=True)
        self.loaders.train.set_epoch(self.epoch)
        batches = iter(self.loaders.train)
        self.t0 = time.perf_counter()
        while not self.done():
            self.tracer.before(self.step + 1)
            try:
                with self.timer.step(self.step + 1):
                    out = pipe.progress(batches)
            except StopIteration:
                break
            self.step += 1
            self.tracer.after(self.step)
            self.losses.append(out[0].detach())
            self.real_rows.append(out[3].sum())
            self.bar.update(1)
            if self.step % cfg.train.log_every_n_steps == 0:
                self.log_train()
            if cfg.eval.every_n_steps and self.step % cfg.eval.every_n_steps == 0:
                pipe.detach()  # the pipeline rewrote forward; eval needs the plain one
                self.validate()
                self.t0 = time.perf_counter()
        if self.losses:
            self.log_train()
        pipe.detach()
        return self.validate()

    def validate(self) -> dict:
        metrics = evaluate(self.dmp, self.loaders.validation, self.ctx.device, self.cfg.eval.auc_buckets)
        self.writer.write(split="validation", step=self.step, epoch=self.epoch, **metrics)
        if metrics.get("auc") is not None:
            self.bar.set_postfix_str(f"val AUC {metrics['auc']:.4f}", refresh=False)
        return metrics

    def log_train(self) -> None:
        """Global mean loss and samples/s since the last train line; one all_reduce."""
        elapsed = time.perf_counter() - self.t0
        stats = torch.stack([torch.stack(self.losses).float().mean(),
                             torch.stack(self.real_rows).float().sum()]).cpu()
        if self.ctx.world_size > 1:
            dist.all_reduce(stats)
        loss, rows = float(stats[0]) / self.ctx.world_size, int(stats[1])
        sps = round(rows / elapsed, 1) if elapsed > 0 else None
        self.writer.write(split="train", step=self.step, epoch=self.epoch, loss=loss, samples_per_s=sps,
                          **self.timer.pop())
        self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=sps, refresh=False)
        self.train_seconds += elapsed
        self.rows_trained += rows
        self.losses, self.real_rows = [], []
        self.t0 = time.perf_counter()
