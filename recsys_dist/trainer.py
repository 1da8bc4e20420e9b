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
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer
from tqdm import tqdm

from recsys_dist import sharding
from recsys_dist.checkpoint import (
    canonical_optimizer_state,
    check_compatible,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    set_optimizer_steps,
)
from recsys_dist.config import RunConfig, save_config
from recsys_dist.data import feature_names, prepare_from_config
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.distributed import DistContext, broadcast_result, init_distributed
from recsys_dist.faults import maybe_fault
from recsys_dist.metrics import StreamingBinaryMetrics, binary_metrics, gather_predictions
from recsys_dist.models import build_model, feature_spec
from recsys_dist.models.build import table_sizes
from recsys_dist.observe import TimedTrainPipeline, TraceWriter
from recsys_dist.optim import build_optimizer, fuse_embedding_optimizer, init_lazy_state
from recsys_dist.schedule import LRSchedule
from recsys_dist.sharding import model_tables
from recsys_dist.spec import FeatureSpec
from recsys_dist.state import init_tables

log = logging.getLogger("recsys_dist")


@dataclass
class Loaders:
    """The three splits' loaders, and the table sizes the data preparation decided."""

    train: ParquetBatchLoader
    validation: ParquetBatchLoader
    test: ParquetBatchLoader
    num_embeddings: list[int]


def make_loaders(cfg: RunConfig, ctx: DistContext) -> Loaders:
    """Convert the raw data once (rank 0) and open every split on every rank."""
    d = cfg.data
    prepared = broadcast_result(ctx, lambda: prepare_from_config(cfg))
    # Under vocabulary mapping the tables are as large as the vocabulary built on train.
    sizes = list(prepared.num_embeddings) if d.categorical_mapping == "vocabulary" else table_sizes(cfg)
    dense_names, sparse_names = feature_names(cfg)
    common = dict(
        rank=ctx.rank,
        world_size=ctx.world_size,
        dense_names=dense_names,
        sparse_names=sparse_names,
        num_embeddings=sizes,
        pin_memory=ctx.device.type == "cuda",
        shuffle_buffer_rows=d.shuffle_buffer_rows,
        prefetch=d.prefetch,
        rank_reads=d.rank_reads,
    )
    eval_bs = cfg.eval.batch_size or cfg.train.batch_size
    return Loaders(
        train=ParquetBatchLoader(
            prepared.paths("train"),
            cfg.train.batch_size,
            shuffle=d.shuffle,
            seed=cfg.train.seed,
            remainder=d.remainder,
            **common,
        ),
        validation=ParquetBatchLoader(prepared.paths("validation"), eval_bs, remainder="pad", **common),
        test=ParquetBatchLoader(prepared.paths("test"), eval_bs, remainder="pad", **common),
        num_embeddings=sizes,
    )


def shard_model(
    cfg: RunConfig, ctx: DistContext, spec: FeatureSpec | None = None
) -> tuple[DistributedModelParallel, CombinedOptimizer, str]:
    """Build on meta, fuse the embedding optimizer into backward, plan, wrap in DMP.

    ``spec``: the run's FeatureSpec (default: one made from the config, with the configured
    table sizes). Every EmbeddingBagCollection table of the built model is planned and
    initialised, whether the spec or the model's own code made it.
    """
    spec = spec or feature_spec(cfg, device=ctx.device)
    model = build_model(cfg, spec.on(torch.device("meta"), ctx.device))
    fuse_embedding_optimizer(model, cfg)
    tables = model_tables(model)
    plan = sharding.collective_plan(cfg, model, tables, ctx.device, dist.group.WORLD)
    dmp = DistributedModelParallel(
        model,
        device=ctx.device,
        plan=plan,
        sharders=sharding.sharders(),
        data_parallel_wrapper=sharding.OneRankDense() if ctx.world_size == 1 else None,
    )
    init_tables(dmp.state_dict(), tables, cfg.train.seed, {t.name: t.weight_init_max for t in tables})
    t = cfg.train
    optimizer = build_optimizer(
        dmp,
        t.embedding_optimizer,
        t.embedding_lr,
        t.dense_optimizer,
        t.dense_lr,
        t.dense_grad_clip_norm,
        t.embedding_weight_decay,
    )
    return dmp, optimizer, str(plan)


@torch.no_grad()
def evaluate(
    dmp: nn.Module,
    loader: ParquetBatchLoader,
    device: torch.device,
    auc_buckets: int | None = None,
    group_feature: str | None = None,
) -> dict:
    """Metrics over every rank's predictions on one split (padding excluded).

    ``auc_buckets`` None: exact, gathers every prediction; N: streaming histogram metrics in
    memory independent of the split's size (``auc_error_bound`` is reported).
    ``group_feature``: a one-hot categorical key whose ids group rows for GAUC. Every rank
    must call this, since both paths end in a collective.
    """
    was_training = dmp.training
    dmp.eval()
    stream = StreamingBinaryMetrics(auc_buckets, device=device) if auc_buckets else None
    logits, labels, weights, groups = [], [], [], []
    for batch in loader:
        if group_feature:
            groups.append(batch.sparse_features[group_feature].values())
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
    if group_feature:
        lg, lb, g = gather_predictions(
            torch.cat(logits), torch.cat(labels), torch.cat(weights), groups=torch.cat(groups).to(device)
        )
        return binary_metrics(lg, lb, groups=g)
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

    def truncate_after(self, step: int) -> None:
        """Drop lines past ``step``: a resumed run writes them again, each step exactly once."""
        if self.enabled and self.path.is_file():
            keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            self.path.write_text("".join(ln + "\n" for ln in keep))

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


def train(cfg: RunConfig, run_dir: Path, profile_dir: Path | None = None, resume: Path | None = None) -> dict:
    """Train and evaluate as configured; returns the summary (also in summary.json).

    ``profile_dir``: write a torch.profiler trace of a few steps per rank there.
    ``resume``: a checkpoint directory to continue from (any world size or plan).
    """
    ctx = init_distributed(cfg)
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    run_dir = Path(run_dir)
    loaders = make_loaders(cfg, ctx)  # first: it may set data.num_embeddings (vocabulary sizes)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    log.info(
        "data ready: %d train / %d validation / %d test rows, %d steps per epoch",
        loaders.train.num_rows,
        loaders.validation.num_rows,
        loaders.test.num_rows,
        len(loaders.train),
    )
    spec = feature_spec(cfg, loaders.num_embeddings, ctx.device)
    dmp, optimizer, plan_text = shard_model(cfg, ctx, spec)
    log.info("sharded: %s", ", ".join(sorted({r["sharding_type"] for r in sharding.plan_summary(dmp.plan)})))
    if ctx.is_main:
        (run_dir / "plan.txt").write_text(plan_text + "\n")
        (run_dir / "plan.json").write_text(json.dumps(sharding.plan_summary(dmp.plan, spec.all_tables()), indent=2))
    loop = _Loop(
        cfg,
        ctx,
        dmp,
        optimizer,
        loaders,
        MetricsWriter(run_dir / "metrics.jsonl", ctx.is_main),
        TraceWriter(profile_dir, ctx.rank),
        run_dir,
    )
    resumed_at = None
    if resume is not None:
        loop.restore(Path(resume))
        resumed_at = loop.step
        if loop.done():  # the checkpoint is the end of this run: report it, change nothing
            log.warning("checkpoint %s is already at the last step (%d); nothing to train", resume, loop.step)
            summary_path = run_dir / "summary.json"
            done = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
            dist.barrier()
            dist.destroy_process_group()
            return {**done, "already_complete": True}
    last_val = loop.run()
    test = evaluate(dmp, loaders.test, ctx.device, cfg.eval.auc_buckets, cfg.eval.group_feature)
    loop.writer.write(split="test", step=loop.step, epoch=loop.epoch, **test)
    summary = {
        "run_dir": str(run_dir),
        "world_size": ctx.world_size,
        "steps": loop.step,
        "rows_trained": loop.rows_trained,
        "train_seconds": round(loop.train_seconds, 3),
        "samples_per_s": round(loop.rows_trained / loop.train_seconds, 1) if loop.train_seconds > 0 else None,
        "resumed_at_step": resumed_at,
        "validation": {k: last_val.get(k) for k in ("auc", "logloss", "ne")},
        "test": {k: test.get(k) for k in ("auc", "logloss", "ne")},
    }
    if cfg.checkpoint.enabled:
        summary["checkpoint"] = str(loop.save())
    if ctx.is_main:
        (run_dir / "summary.json").write_text(json.dumps(finite_or_none(summary), indent=2))
    # Every rank leaves its last collective before any rank tears down gloo; a rank that
    # exited while a peer still had work queued made the peer abort (seen 1 run in 8).
    dist.barrier()
    dist.destroy_process_group()
    return finite_or_none(summary)


class _Loop:
    """The epoch / step loop around ``TrainPipelineSparseDist.progress`` and its logging."""

    def __init__(self, cfg, ctx, dmp, optimizer, loaders, writer, tracer, run_dir) -> None:
        self.cfg, self.ctx, self.dmp, self.optimizer, self.loaders = cfg, ctx, dmp, optimizer, loaders
        self.writer, self.tracer = writer, tracer
        self.pipe = None
        t = cfg.train
        self.schedule = LRSchedule(t.warmup_steps, t.decay_start_step, t.decay_steps)
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.run_dir = run_dir
        self.step = self.epoch = self.rows_trained = 0
        self.first_epoch = self.in_epoch = 0
        self.train_seconds = 0.0
        self.losses: list = []
        self.real_rows: list = []
        self.early_batches = None  # the next epoch's batches, opened during this epoch's validation
        self.t0 = time.perf_counter()
        total = cfg.train.epochs * len(loaders.train)
        self.total_steps = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
        self.bar = tqdm(
            total=self.total_steps,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            leave=False,
            disable=not (ctx.is_main and cfg.train.progress_bar),
        )

    def done(self) -> bool:
        return self.step >= self.total_steps

    def state(self) -> dict:
        return {
            "model": self.dmp.state_dict(),
            "optimizer": canonical_optimizer_state(self.optimizer.state_dict()),
            "rng": torch.get_rng_state(),
        }

    def save(self) -> Path:
        meta = {
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.in_epoch,
            "rows_trained": self.rows_trained,
            "train_seconds": self.train_seconds,
            "world_size": self.ctx.world_size,
            "plan": sharding.plan_summary(self.dmp.plan),
            "config": self.cfg.to_dict(),
            "num_embeddings": self.loaders.num_embeddings,
        }
        return save_checkpoint(self.ctx, self.run_dir, self.step, self.state(), meta, self.cfg.checkpoint.keep)

    def restore(self, path: Path) -> None:
        """Continue from a checkpoint: weights, optimizer state, RNG and the loader position."""
        meta = read_meta(path)
        check_compatible(path, meta, self.cfg.to_dict(), sizes=self.loaders.num_embeddings)
        init_lazy_state(self.optimizer, self.dmp.fused_optimizer)
        state = self.state()
        load_checkpoint(path, state)  # in place: model shards and optimizer state are views
        set_optimizer_steps(self.optimizer, meta["step"])
        torch.set_rng_state(state["rng"])
        self.step, self.rows_trained = meta["step"], meta["rows_trained"]
        self.train_seconds = meta["train_seconds"]
        self.first_epoch, self.in_epoch = meta["epoch"], meta["batches_in_epoch"]
        if self.in_epoch >= len(self.loaders.train):
            self.first_epoch, self.in_epoch = self.first_epoch + 1, 0
        self.writer.truncate_after(self.step)
        self.bar.update(self.step)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, self.step, self.first_epoch, self.in_epoch)

    def run(self) -> dict:
        last_val: dict = {}
        for epoch in range(self.first_epoch, self.cfg.train.epochs):
            if self.done():
                break
            self.epoch = epoch
            last_val = self.run_epoch() or last_val
        self.tracer.close()
        self.bar.close()
        return last_val

    def run_epoch(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        # Sampling counts global steps, so timed steps do not restart with each epoch.
        every = cfg.train.timing_every_n_steps
        pipe = self.pipe = TimedTrainPipeline(
            self.dmp, self.optimizer, ctx.device, execute_all_batches=True, every_n=every
        )
        pipe.steps_done = self.step
        self.loaders.train.set_epoch(self.epoch)
        start, self.in_epoch = (self.in_epoch, self.in_epoch) if self.epoch == self.first_epoch else (0, 0)
        early, self.early_batches = self.early_batches, None
        batches = early if early is not None and start == 0 else self.loaders.train.iter_from(start)
        self.t0 = time.perf_counter()
        while not self.done():
            self.tracer.before(self.step + 1)
            try:
                if self.schedule.active:
                    self.schedule.apply(self.optimizer, self.base_lrs, self.step)
                    # FBGEMM takes a new rate at its optimizer's step(), which only sets the
                    # rate; calling it now makes this step's fused update use it.
                    self.dmp.fused_optimizer.step()
                out = pipe.progress(batches)
            except StopIteration:
                break
            self.step += 1
            self.in_epoch += 1
            maybe_fault("step", self.step, self.ctx.rank)
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
            every = cfg.checkpoint.every_n_steps
            if cfg.checkpoint.enabled and every and self.step % every == 0 and not self.done():
                if self.losses:  # close the logging window here, so a resumed run logs the same lines
                    self.log_train()
                self.save()
                self.t0 = time.perf_counter()
        if self.losses:
            self.log_train()
        pipe.detach()
        if self.epoch + 1 < cfg.train.epochs and not self.done():
            # The loader's prefetch thread starts on opening: the next epoch's first window
            # (40-150 ms) is read while this epoch's validation runs.
            self.loaders.train.set_epoch(self.epoch + 1)
            self.early_batches = self.loaders.train.iter_from(0)
        return self.validate()

    def validate(self) -> dict:
        metrics = evaluate(
            self.dmp, self.loaders.validation, self.ctx.device, self.cfg.eval.auc_buckets, self.cfg.eval.group_feature
        )
        self.writer.write(split="validation", step=self.step, epoch=self.epoch, **metrics)
        if metrics.get("auc") is not None:
            self.bar.set_postfix_str(f"val AUC {metrics['auc']:.4f}", refresh=False)
        return metrics

    def diverged(self) -> None:
        """Stop with the first bad step of this window, the first non-finite parameter and
        the last good checkpoint (checkpoints are only written after a finite window)."""
        local = torch.stack(self.losses).float()
        bad = torch.nonzero(~torch.isfinite(local)).flatten()
        first = self.step - len(local) + 1 + (int(bad[0]) if len(bad) else 0)
        param = next((n for n, p in self.dmp.named_parameters() if not torch.isfinite(p).all()), None)
        from recsys_dist.checkpoint import latest_checkpoint

        good = latest_checkpoint(self.run_dir)
        raise FloatingPointError(
            f"non-finite training loss at step {first} (steps {self.step - len(local) + 1}-{self.step} checked "
            f"together); first non-finite parameter: {param or 'none (the loss itself overflowed)'}; "
            f"last good checkpoint: {good or 'none'}. Lower train.embedding_lr / train.dense_lr"
            + (", then continue with --resume auto." if good else " and start again.")
        )

    def log_train(self) -> None:
        """Global mean loss and samples/s since the last train line; one all_reduce."""
        elapsed = time.perf_counter() - self.t0
        stats = torch.stack([torch.stack(self.losses).float().mean(), torch.stack(self.real_rows).float().sum()]).cpu()
        if self.ctx.world_size > 1:
            dist.all_reduce(stats)
        loss, rows = float(stats[0]) / self.ctx.world_size, int(stats[1])
        if not math.isfinite(loss):  # identical on every rank (all-reduced), so all stop here
            self.diverged()
        sps = round(rows / elapsed, 1) if elapsed > 0 else None
        lr = {"lr_scale": round(self.schedule.scale(self.step - 1), 6)} if self.schedule.active else {}
        self.writer.write(
            split="train",
            step=self.step,
            epoch=self.epoch,
            loss=loss,
            samples_per_s=sps,
            **lr,
            **(self.pipe.pop_times() if self.pipe else {}),
        )
        self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=sps, refresh=False)
        self.train_seconds += elapsed
        self.rows_trained += rows
        self.losses, self.real_rows = [], []
        self.t0 = time.perf_counter()
