"""Item 5 of benchmarks/run.py: samples/s and peak RSS as table rows and batch size grow.

One rank, one intra-op thread. The model: torchrec's DLRM with ``TABLES`` tables
of N rows x dim 16 (MLPs 13-64-16 / 64-32-1, as the quickstart), row-wise Adagrad fused
into backward, sharded by ``recsys_dist.distributed.sharding.shard`` (table_wise), trained with
TrainPipelineSparseDist on synthetic batches: ids uniform in [0, N) (the worst case for
caches), dense features N(0, 1), labels 0/1. Each point builds a fresh model; the peak RSS
of the point is read from /proc/self/status (VmHWM) after resetting it
(/proc/self/clear_refs), and the baseline RSS before the model exists is reported with it.
"""

from __future__ import annotations

import gc
import itertools
import time

import torch

TABLES = 4


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def synthetic_batches(n: int, rows: int, batch: int, device: torch.device, seed: int = 0) -> list:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(TABLES)]
    return [
        Batch(
            dense_features=torch.randn(batch, 13, generator=g),
            sparse_features=KeyedJaggedTensor(
                keys=keys,
                values=torch.randint(0, rows, (TABLES * batch,), generator=g),
                lengths=torch.ones(TABLES * batch, dtype=torch.int32),
                stride=batch,
            ),
            labels=torch.randint(0, 2, (batch,), generator=g).float(),
        )
        for _ in range(n)
    ]


def point(rows: int, batch: int, device: torch.device, seconds: float, mlperf: bool = False) -> dict:
    """samples/s, peak and baseline RSS (MB) of one (rows per table, batch) point; ``mlperf``: the
    MLPerf DLRMv2 dense part (dim 128, MLPs 512-256-128 / 1024-1024-512-256-1, 3 low-rank cross layers)."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recsys_dist.distributed.sharding import shard

    gc.collect()
    base = _rss_mb("VmRSS")
    _reset_peak()
    batches = synthetic_batches(4, rows, batch, device)
    dim = 128 if mlperf else 16
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(TABLES)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    if mlperf:
        dlrm = DLRM_DCN(
            ebc,
            13,
            [512, 256, 128],
            [1024, 1024, 512, 256, 1],
            dcn_num_layers=3,
            dcn_low_rank_dim=512,
            dense_device=device,
        )
    else:
        dlrm = DLRM(ebc, 13, [64, 16], [64, 32, 1], dense_device=device)
    model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.02, "eps": 1e-8})
    dmp = shard(model, {"sharding_types": ["table_wise"]}, device=device, batch_size=batch)
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.Adagrad(ps, lr=0.02)
    )
    pipe = TrainPipelineSparseDist(dmp, opt, device)
    it = itertools.cycle(batches)
    for _ in range(3):
        pipe.progress(it)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        pipe.progress(it)
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    sps = n * batch / (time.perf_counter() - t0)
    out = {
        "rows": rows,
        "batch": batch,
        "samples_per_s": sps,
        "peak_rss_mb": _rss_mb("VmHWM"),
        "base_rss_mb": base,
        "table_mb": TABLES * rows * (dim + 1) * 4 / 2**20,
    }  # weights + row-wise Adagrad state
    if device.type == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
    del pipe, dmp, opt, model, ebc, batches
    gc.collect()
    return out


def sweep(
    rank: int,
    world: int,
    rows_list: list[int],
    batches: list[int],
    fixed_rows: int,
    fixed_batch: int,
    seconds: float,
    mlperf: bool = False,
    device_type: str = "cpu",
) -> dict:
    """run_ranks target (world size 1): the rows sweep at ``fixed_batch``, the batch sweep at ``fixed_rows``;
    ``mlperf``: the MLPerf dense part (see :func:`point`), on ``device_type`` (cpu or cuda)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    # One intra-op thread: on a 2-core machine shared with other jobs, 2 OpenMP threads made
    # steps up to 160x slower (a barrier waits for a descheduled thread); see docs/benchmarks.md.
    torch.set_num_threads(1)
    return {
        "rows": [point(r, fixed_batch, device, seconds, mlperf) for r in rows_list],
        "batch": [point(fixed_rows, b, device, seconds, mlperf) for b in batches],
    }
