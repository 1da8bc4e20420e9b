"""Your own training loop on recsys_dist's pieces: shard a model you wrote, train it with a plain
loop, checkpoint, and resume, with public names only (docs/api.md, "Your own loop").

    python examples/own_loop/train.py [--run-dir DIR] [--steps 60] [--stop-at 30] [--nproc 2]

On the 10,000 Criteo rows shipped in datasets/ and 2 CPU ranks: trains ``--steps`` steps
(checkpointing every 10) and writes each step's global loss to RUN_DIR/losses.json. With
``--stop-at K`` it stops after step K, then a second launch resumes from the newest checkpoint
and finishes: the losses equal those of an uninterrupted run (tests/e2e/examples/test_examples.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import recsys_dist

# TorchRec's, torch.fx's and torch.distributed's notices about their internals (in the ranks too:
# each imports this file again).
warnings.filterwarnings("ignore")
for name in ("torch.fx._symbolic_trace", "torchrec", "torch.distributed", "fbgemm_gpu"):
    logging.getLogger(name).setLevel(logging.ERROR)
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "criteo_quickstart.yaml"  # its data: section


class Model(nn.Module):
    """Pooled embeddings of every categorical feature, concatenated with the dense features,
    through an MLP to one logit [B]."""

    def __init__(self, spec: recsys_dist.FeatureSpec) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=spec.tables, device=torch.device("meta"))  # shard() places it
        width = spec.num_dense + len(spec.tables) * spec.embedding_dim
        self.mlp = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(sparse).values()  # [B, F * E], features in spec.sparse_names order
        return self.mlp(torch.cat([dense, pooled], dim=1)).squeeze(-1)


def job(run_dir: str, steps: int, stop_at: int) -> None:
    """One rank: build, shard, resume if a checkpoint exists, train until ``stop_at``."""
    dist.init_process_group("gloo")  # launch() sets the launcher's env:// variables
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = recsys_dist.load_config(CONFIG)
    prepared = recsys_dist.prepare(cfg)  # cached: the launching process converted it already
    spec = recsys_dist.feature_spec(cfg, prepared.num_embeddings)
    torch.manual_seed(0)  # the dense weights: the same on every rank and in every run
    model = Model(spec)
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.02})  # fused into backward
    dmp = recsys_dist.shard(model, {"sharding_types": ["row_wise", "table_wise"]}, seed=0)
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))  # all but the tables
    optimizer = torch.optim.Adam(dense_params.values(), lr=0.002)
    loader = recsys_dist.ParquetBatchLoader(
        prepared.paths("train"), 32, rank, world, spec.dense_names, spec.sparse_names, shuffle=True, seed=0
    )
    step, epoch, batch_in_epoch, losses = 0, 0, 0, []
    if recsys_dist.latest_checkpoint(run_dir) is not None:
        resumed = recsys_dist.load_checkpoint(run_dir, dmp, optimizer)  # model, optimizers, RNG
        step, epoch, batch_in_epoch = resumed.step, resumed.extra["epoch"], resumed.extra["batch"]
        losses = resumed.extra["losses"]

    while step < min(steps, stop_at):
        loader.set_epoch(epoch)  # the epoch's shuffle
        for batch in loader.iter_from(batch_in_epoch):
            logits = dmp(batch.dense_features, batch.sparse_features)
            rows = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
            # A weighted mean over this rank's rows (padding has weight 0), scaled so that DDP's
            # mean over ranks is the mean over the global batch.
            loss = (rows * batch.weights).sum() / batch.weights.sum().clamp(min=1) * batch.loss_scale
            optimizer.zero_grad()
            loss.backward()  # also updates the embedding rows (fused optimizer)
            optimizer.step()
            step, batch_in_epoch = step + 1, batch_in_epoch + 1
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
            if step % 10 == 0 or step == stop_at:
                position = {"epoch": epoch, "batch": batch_in_epoch, "losses": losses}
                recsys_dist.save_checkpoint(run_dir, dmp, optimizer, step=step, extra=position)
            if step >= min(steps, stop_at):
                break
        else:
            epoch, batch_in_epoch = epoch + 1, 0
    if rank == 0:
        Path(run_dir, "losses.json").write_text(json.dumps(losses))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/own_loop")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (then run again to resume)")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    recsys_dist.prepare(recsys_dist.load_config(CONFIG))  # convert once, before the ranks start
    stop = a.stop_at if a.stop_at is not None else a.steps
    recsys_dist.launch(job, a.nproc, a.run_dir, a.steps, stop)
    if stop < a.steps:  # the second launch: resume from the newest checkpoint and finish
        recsys_dist.launch(job, a.nproc, a.run_dir, a.steps, a.steps)
    losses = json.loads(Path(a.run_dir, "losses.json").read_text())
    print(f"{len(losses)} steps, loss first {losses[0]:.4f}, last {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
