"""Item 6 of benchmarks/run.py: the hardware limit of one config.

Arithmetic from the run config (no process group, no data):

- bytes moved per training sample by the embedding tables (fp32): per id looked up, the
  row is read in forward (4 D bytes), read and written by the fused optimizer in backward
  (8 D) and its optimizer state read and written (8 S, S = state floats per row: 1 for
  row-wise Adagrad, D for Adagrad, 2 D for Adam, 0 for SGD); per feature the pooled vector
  is written in forward and its gradient read in backward (8 D). Dense weights are read
  once per batch, not per sample, and are left out.
- FLOPs per training sample of the dense part: 2 x in x out per Linear layer, the dot
  interaction's batched matmul ((F+1)^2 x D x 2) or the low-rank cross layers (4 d r each);
  backward counted as twice forward (3x in all).

Measurements (call them on every rank at once, so the ranks share the machine as they do
while training): copy bandwidth of a large fp32 tensor (bytes read + written per second)
and torch.mm FLOP/s at the model's Linear shapes (forward, grad-input and grad-weight).
"""

from __future__ import annotations

import time

import torch

STATE_FLOATS = {
    "exact_rowwise_adagrad": lambda d: 1,
    "exact_adagrad": lambda d: d,
    "exact_sgd": lambda d: 0,
    "adam": lambda d: 2 * d,
}


def embedding_bytes_per_sample(cfg) -> int:
    """Bytes of embedding rows, optimizer state and pooled vectors moved per training sample."""
    from recsys_dist import resolve_job

    hot = cfg.data.multi_hot_sizes
    state = STATE_FLOATS[cfg.train.embedding_optimizer]
    total = 0
    for i, t in enumerate(resolve_job(cfg).features.planned_tables()):
        ids = hot[i % len(hot)] if hot else 1
        d = t.embedding_dim
        total += ids * (12 * d + 8 * state(d)) + 8 * d
    return total


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of every Linear layer of the dense part of a dlrm / dlrm_dcnv2 model."""
    from recsys_dist import resolve_job

    m = cfg.model
    features = resolve_job(cfg).features
    dense, sparse = features.dense_names, features.keys
    f, d = len(sparse), m.embedding_dim
    bottom = list(zip([len(dense)] + m.dense_arch_layer_sizes[:-1], m.dense_arch_layer_sizes))
    top_in = (f + 1) * d if m.name == "dlrm_dcnv2" else d + (f + 1) * f // 2
    if m.name not in ("dlrm", "dlrm_dcnv2"):
        raise ValueError(f"hardware limit: model {m.name} not modelled (dlrm, dlrm_dcnv2)")
    top = list(zip([top_in] + m.over_arch_layer_sizes[:-1], m.over_arch_layer_sizes))
    return bottom + top


def flops_per_sample(cfg) -> int:
    """Training FLOPs per sample (forward + backward = 3x forward) of the dense part."""
    from recsys_dist import resolve_job

    m = cfg.model
    f, d = len(resolve_job(cfg).features.keys), m.embedding_dim
    fwd = sum(2 * i * o for i, o in linear_shapes(cfg))
    if m.name == "dlrm_dcnv2":
        width = (f + 1) * d
        fwd += m.dcn_num_layers * (4 * width * m.dcn_low_rank_dim + 3 * width)
    else:
        fwd += 2 * (f + 1) ** 2 * d
    return 3 * fwd


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mbytes: int = 256, seconds: float = 0.5) -> float:
    """Bytes per second (read + written) of ``dst.copy_(src)`` on ``mbytes`` MB fp32 tensors."""
    src = torch.rand(mbytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        dst.copy_(src)
        n += 1
        _sync(device)
    return 2 * src.numel() * 4 * n / (time.perf_counter() - t0)


def mm_flops(
    shapes: list[tuple[int, int]],
    batch: int,
    device: torch.device,
    seconds: float = 0.5,
    dtype: torch.dtype = torch.float32,
) -> float:
    """FLOP/s of torch.mm over each Linear's forward, grad-input and grad-weight products at ``batch``."""
    mats = []
    for i, o in shapes:
        x, w, g = (
            torch.rand(batch, i, device=device, dtype=dtype),
            torch.rand(i, o, device=device, dtype=dtype),
            torch.rand(batch, o, device=device, dtype=dtype),
        )
        mats += [(x, w), (g, w.t()), (g.t(), x)]
    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in mats)
    for a, b in mats:
        torch.mm(a, b)
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        for a, b in mats:
            torch.mm(a, b)
        n += 1
        _sync(device)
    return flops * n / (time.perf_counter() - t0)
