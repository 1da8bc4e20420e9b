"""What benchmarks/run.py measures our trainer against (items 1-3), none of it using the trainer.

- :func:`memory_batches`: one rank's batches of a Parquet split read whole with pyarrow,
  as torchrec ``Batch`` objects held in memory (one-hot ids, KJT layout of the loader).
- :func:`handwritten_torchrec`: a minimal TorchRec loop: torchrec's DLRM, row-wise Adagrad
  fused into backward, the planner limited to one sharding type, DistributedModelParallel,
  TrainPipelineSparseDist.
- :class:`PlainDLRM` / :func:`plain_pytorch`: DLRM in plain PyTorch: one ``nn.EmbeddingBag``
  per feature with sparse gradients, ``torch.optim.Adagrad`` on everything, the whole model in DDP
  (sparse gradients averaged by an all-gather comm hook: gloo's sparse all-reduce is broken).
- ``DEEPCTR_WORKER``: DeepCTR-Torch's DeepFM timed in its own Python (``-c``).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def memory_batches(
    path: str, rank: int, world: int, batch: int, dense: list[str], sparse: list[str], limit: int
) -> list[Batch]:
    """Up to ``limit`` batches of this rank (global batch g, rank r: rows [(g W + r) B, +B))."""
    t = pq.read_table(path, columns=["label", *dense, *sparse])
    labels = t.column("label").to_numpy().astype(np.float32)
    x = np.stack([t.column(n).to_numpy().astype(np.float32) for n in dense], axis=1)
    ids = np.stack([t.column(n).to_numpy().astype(np.int64) for n in sparse], axis=0)  # [F, N]
    out = []
    for g in range(min(limit, len(labels) // (batch * world))):
        lo = (g * world + rank) * batch
        kjt = KeyedJaggedTensor(
            keys=sparse,
            values=torch.from_numpy(ids[:, lo : lo + batch].reshape(-1).copy()),
            lengths=torch.ones(len(sparse) * batch, dtype=torch.int32),
            stride=batch,
        )
        out.append(
            Batch(
                dense_features=torch.from_numpy(x[lo : lo + batch].copy()),
                sparse_features=kjt,
                labels=torch.from_numpy(labels[lo : lo + batch].copy()),
            )
        )
    return out


def timed_steps(step, n: int) -> float:
    """Seconds for ``n`` calls of ``step()`` between two barriers."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    dist.barrier()
    return time.perf_counter() - t0


def handwritten_torchrec(
    batches: list[Batch],
    sizes: list[int],
    dim: int,
    bottom: list[int],
    top: list[int],
    sharding_type: str | None,
    lr: float,
    device: torch.device,
    dcn: tuple | None = None,
    exact_adagrad: bool = False,
):
    """A minimal TorchRec DLRM training loop; returns ``step()``: ``progress()`` of its pipeline over
    ``batches``. ``dcn``: (layers, rank) for DLRM-DCNv2 (MLPerf); ``sharding_type`` None = planner's choice;
    the tables' fused optimizer is FBGEMM's row-wise Adagrad, or its exact (per-element) Adagrad
    with ``exact_adagrad`` (MLPerf's)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import Adagrad, in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    keys = batches[0].sparse_features.keys()
    tables = [
        EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=n, feature_names=[k])
        for k, n in zip(keys, sizes)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    num_dense = batches[0].dense_features.shape[1]
    model = DLRMTrain(
        DLRM_DCN(ebc, num_dense, bottom, top, dcn_num_layers=dcn[0], dcn_low_rank_dim=dcn[1], dense_device=device)
        if dcn
        else DLRM(ebc, num_dense, bottom, top, dense_device=device)
    )
    table_opt = Adagrad if exact_adagrad else RowWiseAdagrad
    apply_optimizer_in_backward(table_opt, ebc.parameters(), {"lr": lr, "eps": 1e-8})
    world = dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=world, compute_device=device.type),
        batch_size=batches[0].labels.shape[0],
        constraints={t.name: ParameterConstraints(sharding_types=[sharding_type]) for t in tables}
        if sharding_type
        else None,
    )
    plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[EmbeddingBagCollectionSharder()])
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adagrad(ps, lr=lr))
    return pipeline_stepper(TrainPipelineSparseDist(dmp, opt, device), batches)


def pipeline_stepper(pipe, batches: list):
    """``step()`` advancing ``pipe`` over ``batches`` cycled forever."""
    it = itertools.cycle(batches)
    return lambda: pipe.progress(it)


class PlainDLRM(nn.Module):
    """DLRM (Naumov et al., 2019) in plain PyTorch, the same shapes as torchrec's DLRM:
    bottom MLP, pairwise dot products of the F+1 vectors (upper triangle), top MLP."""

    def __init__(self, num_dense: int, sizes: list[int], dim: int, bottom: list[int], top: list[int]) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in sizes)

        def mlp(i: int, outs: list[int], last_relu: bool) -> nn.Sequential:
            layers: list[nn.Module] = []
            for k, o in enumerate(outs):
                layers += [nn.Linear(i, o)] + ([nn.ReLU()] if last_relu or k < len(outs) - 1 else [])
                i = o
            return nn.Sequential(*layers)

        f = len(sizes)
        self.bottom = mlp(num_dense, bottom, True)
        self.top = mlp(dim + (f + 1) * f // 2, top, False)
        self.register_buffer("tri", torch.triu_indices(f + 1, f + 1, offset=1), persistent=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """dense [B, num_dense] float32, ids [B, F] int64 (one id per feature) -> logits [B]."""
        x = self.bottom(dense)
        v = torch.stack([x] + [t(ids[:, j : j + 1]) for j, t in enumerate(self.tables)], dim=1)
        z = torch.bmm(v, v.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


def sparse_allgather_hook(state, bucket):  # no annotations: DDP checks them against the real types
    """DDP communication hook: a bucket's mean over ranks. A sparse gradient (one bucket per
    ``nn.EmbeddingBag(sparse=True)``) is all-gathered as one packed int64 tensor of [id, 16
    float32 values as 8 int64], asynchronously like DDP's own all-reduce; every rank must have
    the same number of ids per table (one id per feature per sample, equal batches: true here).
    Stands in for gloo's sparse all-reduce, which corrupts the heap within a few thousand steps
    on torch 2.13 CPU: a 30-line DDP over 26 ``nn.EmbeddingBag(sparse=True)``, nothing of this
    project, aborts with "malloc(): unaligned tcache chunk detected" in backward."""
    world = dist.get_world_size()
    grad = bucket.buffer()
    if not grad.is_sparse:
        return dist.all_reduce(grad.div_(world), async_op=True).get_future().then(lambda f: f.value()[0])
    idx, val = grad._indices()[0], grad._values().contiguous()
    packed = torch.cat([idx.unsqueeze(1), val.view(torch.int64)], dim=1)
    parts = [torch.empty_like(packed) for _ in range(world)]

    def unpack(_) -> torch.Tensor:
        every = torch.cat(parts)
        values = every[:, 1:].contiguous().view(val.dtype)
        return torch.sparse_coo_tensor(every[:, :1].t(), values / world, grad.shape)

    return dist.all_gather(parts, packed, async_op=True).get_future().then(unpack)


def plain_pytorch(batches: list[Batch], sizes: list[int], dim: int, bottom: list[int], top: list[int], lr: float):
    """``step()`` of the plain-PyTorch DLRM in DDP; sparse gradients averaged by
    :func:`sparse_allgather_hook` (gloo's built-in sparse all-reduce corrupts the heap)."""
    from torch.nn.parallel import DistributedDataParallel

    data = [
        (b.dense_features, b.sparse_features.values().view(len(sizes), -1).t().contiguous(), b.labels) for b in batches
    ]
    model = DistributedDataParallel(PlainDLRM(data[0][0].shape[1], sizes, dim, bottom, top))
    model.register_comm_hook(None, sparse_allgather_hook)
    opt = torch.optim.Adagrad(model.parameters(), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    it = itertools.cycle(data)

    def step() -> None:
        dense, ids, labels = next(it)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(dense, ids), labels).backward()
        opt.step()

    return step


def mlp_alone(in_features: int, sizes: list[int], batch: int, seconds: float = 1.0, bf16: bool = False) -> float:
    """samples/s of a deep MLP alone (``in_features`` -> ``sizes`` -> 1, ReLU), forward, backward
    and Adagrad on a fixed batch, on this process's threads: what DeepFM's deep part costs any
    implementation, the ceiling of item 3 at small tables. ``bf16``: forward under bfloat16
    autocast, as ``train.precision: bf16-mixed``."""
    layers: list[nn.Module] = []
    for size in sizes:
        layers += [nn.Linear(in_features, size), nn.ReLU()]
        in_features = size
    mlp = nn.Sequential(*layers, nn.Linear(in_features, 1))
    x = torch.randn(batch, mlp[0].in_features)
    opt = torch.optim.Adagrad(mlp.parameters(), lr=0.01)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = mlp(x)
        y.float().sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(10):
        step()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return n * batch / (time.perf_counter() - t0)


# argv[1]: JSON {"train": parquet, "dense", "sparse", "sizes", "dim", "deep", "batch", "rows", "threads"}.
# Prints {"samples_per_s": ..., "rows": ...}: one epoch of DeepFM.fit over the first ``rows`` rows.
DEEPCTR_WORKER = r"""
import json, sys, time, numpy as np, pyarrow.parquet as pq, torch
from deepctr_torch.inputs import DenseFeat, SparseFeat, get_feature_names
from deepctr_torch.models import DeepFM
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
t = pq.read_table(spec["train"]).slice(0, spec["rows"])
cols = [SparseFeat(n, vocabulary_size=v, embedding_dim=spec["dim"]) for n, v in zip(spec["sparse"], spec["sizes"])]
cols += [DenseFeat(n, 1) for n in spec["dense"]]
x = {n: t.column(n).to_numpy() for n in get_feature_names(cols)}
y = t.column("label").to_numpy()
torch.manual_seed(0)
m = DeepFM(cols, cols, dnn_hidden_units=tuple(spec["deep"]), l2_reg_linear=0.0, l2_reg_embedding=0.0,
           l2_reg_dnn=0.0, task="binary", device="cpu")
m.compile(torch.optim.Adagrad(m.parameters(), lr=0.02), "binary_crossentropy", metrics=[])
t0 = time.perf_counter()
m.fit(x, y, batch_size=spec["batch"], epochs=1, verbose=0, shuffle=True)
print(json.dumps({"samples_per_s": len(y) / (time.perf_counter() - t0), "rows": len(y)}))
"""
