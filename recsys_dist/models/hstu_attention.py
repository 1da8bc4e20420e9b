"""HSTU's pointwise aggregated attention (Zhai et al., 2024, eq. 2), the kernel alone:
``A V = (SiLU(Q K^T + bias) * W) V`` per head, no softmax, over padded tokens: the kernel of
``HSTULayer.forward`` (the padded layer). The models run the packed one,
``recsys_dist.models.hstu_jagged``, which skips the padding; the measurements below are of the
padded layers, before it.

Two kernels with one interface (:func:`pointwise_attention`), equal to float rounding:

- ``dense``: the whole ``[B, H, N, N]`` score matrix at once. Autograd keeps two of them a
  layer for the backward pass (the scores plus bias, the weighted SiLU) and the forward pass
  holds about four at its peak: at B = 64, H = 2, N = 801 each is 328 MB.
- ``chunked``: ``CHUNK_QUERIES`` query rows at a time; under autograd each chunk runs under
  ``torch.utils.checkpoint`` (non-reentrant), which keeps only the chunk's inputs (views of
  q, k, v, the bias and the weights, no copies) and computes the chunk's scores again in the
  backward pass. No ``[B, H, N, N]`` tensor is kept for backward or built at once; the
  ``[B | 1, 1 | H, N, N]`` bias and the ``[B, N, N]`` weights the caller passes remain.
- ``auto``: ``dense`` below ``AUTO_CHUNKED_FROM`` tokens, ``chunked`` from there, by
  measurement (benchmarks/results/hstu_attention_cpu2core_20261205.md, the shipped HSTU config
  at B = 64, 2 layers, 2 heads, one CPU thread, a training step, two runs on a loaded
  machine): at N = 51 (one chunk: the recomputation is pure overhead) chunked takes 1.3x-1.7x
  the dense time; at N = 101 and 201 about the same (0.89x-1.05x); at N = 401 0.76x and at
  N = 801 0.52x-0.79x, with the peak memory growth of a step 0.84x and 0.40x-0.47x the dense
  one's (751-886 MiB against about 1,900 MiB at N = 801).

The bias is passed in precomputed and added to the scores (``rab``: the relative position
bias, and any other additive term such as a time bias), so what goes into the scores is the
caller's and the kernel only decides how the N x N matrix is evaluated.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

KERNELS = ("auto", "dense", "chunked")
CHUNK_QUERIES = 64  # query rows per chunk of the chunked kernel
AUTO_CHUNKED_FROM = 128  # tokens (N) from which ``auto`` takes the chunked kernel


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[B, n, H, dv]``: the attention output of the queries ``q`` [B, n, H, dqk] over every
    key (``k`` [B, N, H, dqk], ``v`` [B, N, H, dv]); ``bias`` [B | 1, H | 1, n, N], ``weight``
    [B, n, N]."""
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) + bias
    att = F.silu(scores) * weight.unsqueeze(1)  # masked keys weigh exactly 0
    return torch.einsum("bhnm,bmhd->bnhd", att, v)


@torch.fx.wrap  # a leaf for torch.fx (TrainPipelineSparseDist traces the model): it reads shapes
def pointwise_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor, kernel: str = "auto"
) -> torch.Tensor:
    """HSTU attention (module docstring) of ``N`` padded tokens, float32.

    Args:
        q, k: [B, N, H, d_qk] queries and keys (after eq. 1's SiLU).
        v: [B, N, H, d_v] values.
        bias: additive term of the scores, broadcast to [B, H, N, N]: [B | 1, H | 1, N, N]
            (query i, key j), e.g. the relative position bias ``rab^p``.
        weight: [B, N, N], query i's weight of key j: ``1 / c_i`` where i may read j, exactly
            0 where it may not (causal mask, padding).
        kernel: ``"dense"``, ``"chunked"`` or ``"auto"`` (by N, module docstring).

    Returns:
        [B, N, H * d_v]: ``sum_j SiLU(q_i . k_j + bias_ij) * weight_ij * v_j`` per head,
        the heads concatenated.

    Raises:
        ValueError: an unknown ``kernel``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"pointwise_attention: kernel must be one of {KERNELS}, got {kernel!r}")
    n = q.shape[1]
    if kernel == "dense" or (kernel == "auto" and n < AUTO_CHUNKED_FROM):
        return _block(q, k, v, bias, weight).flatten(2)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, bias, weight))
    # split, not slices: the backward of a split is one concatenation of the chunks' gradients,
    # where each slice's would write its chunk into a zero tensor of the whole bias
    biases = bias.split(CHUNK_QUERIES, dim=2) if bias.shape[2] > 1 else [bias] * math.ceil(n / CHUNK_QUERIES)
    parts = []
    for qc, bc, wc in zip(q.split(CHUNK_QUERIES, dim=1), biases, weight.split(CHUNK_QUERIES, dim=1)):
        args = (qc, k, v, bc, wc)
        parts.append(checkpoint(_block, *args, use_reentrant=False) if recompute else _block(*args))
    return torch.cat(parts, dim=1).flatten(2)
