"""HSTU over packed tokens: the layers' compute without the batch's padding (the reference's
"jagged" HSTU, facebookresearch/generative-recommenders ``SequentialTransductionUnitJagged``,
here in plain torch ops for CPU and GPU alike).

A batch's tokens are packed row after row, ``[T, D]`` with ``T = sum(tokens)``
(:func:`pack`): the pointwise parts of a layer (both layer norms, the UVQK projection ``f_1``,
the gate and the output projection ``f_2``) run on the ``T`` real tokens only
(``HSTULayer.forward_jagged``). The attention (:func:`jagged_attention`) takes the rows sorted
by length, longest first, and walks the query positions in blocks of ``BLOCK``: block
``[s, e)`` takes only the rows with more than ``s`` tokens (a prefix of the sorted rows) and
only the keys ``[0, e)`` (causal: no query of the block reads a later key). What stays padded:
within a block, a row shorter than ``e`` still computes its scores up to ``e`` (at most
``BLOCK`` positions past its end per row, plus the block's causal upper triangle), exactly
weighted 0 and dropped. So the attention costs about ``sum_b n_b^2 / 2`` (plus ``BLOCK`` per
row and position) instead of ``B N^2``: padded rows and the causal half are skipped.

Exactness: each valid token's output, and every gradient, equals the padded computation's
(``HSTULayer.forward``, ``recsys_dist.models.hstu_attention``) to float rounding: the same
bias, weights ``1 / c_i`` and SiLU, the padded keys simply absent instead of weighted 0
(tests/unit/models/test_hstu_jagged.py, float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from recsys_dist.models import hstu_time

BLOCK = 32  # query positions per block of the jagged attention
# ``attention: auto`` recomputes the blocks in backward from this many scores a layer (all blocks,
# rows, heads): each kept score costs about 12 bytes (the scores, their SiLU, the weighted ones),
# so about 200 MiB a layer at most are kept (hstu_jagged_cpu2core_20261205.md)
AUTO_RECOMPUTE_SCORES = 2**24


def position_bucket(distance: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket (int64, same shape) of each relative distance ``i - j >= 0`` (in events): one
    bucket per distance below ``num_buckets // 2``, then four per doubling of the distance
    (``half + floor(4 log2(d / half))``), every larger distance in the last bucket
    ``num_buckets - 1``."""
    half = max(num_buckets // 2, 1)
    far = half + torch.floor(4 * torch.log2(distance.clamp(min=half).float() / half)).long()
    return torch.where(distance < half, distance, far).clamp(max=num_buckets - 1)


@dataclass(frozen=True)
class JaggedLayout:
    """Where a batch's packed tokens sit (:func:`layout`); shared by every layer of a stack.

    ``order`` int64 [B]: the rows by token count, longest first (stable); ``keys`` int64 [B]:
    per sorted row, how many of its first tokens may be read as keys (the others, e.g. the one
    token of an empty retrieval history, read nothing); ``to_padded`` int64 [B, M]: per sorted
    row and position, the packed token's index, ``T`` (a zero row appended) past the row's end;
    ``to_packed`` int64 [T]: per packed token, its index in the flattened ``[B, M]``;
    ``rows``: per block of ``block`` query positions, how many sorted rows reach into it;
    ``width`` M: the longest row's token count; ``pairs``: the (query, key) pairs the blocks
    score, over all rows (a head's)."""

    order: torch.Tensor
    keys: torch.Tensor
    to_padded: torch.Tensor
    to_packed: torch.Tensor
    rows: tuple[int, ...]
    width: int
    block: int
    pairs: int


# Leaves for torch.fx (TrainPipelineSparseDist traces the model): they read values and shapes.
@torch.fx.wrap
def layout(tokens: torch.Tensor, keys: torch.Tensor | None = None, block: int | None = None) -> JaggedLayout:
    """The :class:`JaggedLayout` of rows of ``tokens`` (int64 [B] >= 0) packed tokens each, of
    which the first ``keys`` (int64 [B], <= tokens; None: all) may be read; ``block`` (None:
    ``BLOCK``) query positions a block. One host sync (the block sizes)."""
    block = block or BLOCK
    tokens = tokens.long()
    keys = tokens if keys is None else keys.long()
    order = torch.argsort(tokens, descending=True, stable=True)
    sorted_tokens = tokens[order]
    width = int(sorted_tokens[0]) if len(tokens) else 0
    starts = torch.cumsum(tokens, 0) - tokens  # packed index of each row's first token
    pos = torch.arange(width, device=tokens.device)
    valid = pos[None, :] < sorted_tokens[:, None]  # [B, M]
    total = int(tokens.sum())
    to_padded = torch.where(valid, starts[order][:, None] + pos[None, :], total)
    to_packed = torch.empty(total, dtype=torch.long, device=tokens.device)
    to_packed[to_padded[valid]] = torch.arange(valid.numel(), device=tokens.device).view_as(valid)[valid]
    begins = torch.arange(0, width, block, device=tokens.device)
    rows = tuple((sorted_tokens[None, :] > begins[:, None]).sum(dim=1).tolist())
    pairs = sum(r * (min(b + block, width) - b) * min(b + block, width) for b, r in zip(range(0, width, block), rows))
    return JaggedLayout(order, keys[order], to_padded, to_packed, rows, width, block, pairs)


@torch.fx.wrap
def pack(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[T, D]: the rows of ``x`` [B, N, D] where ``real`` (bool [B, N]) holds, row after row."""
    return x[real]


@torch.fx.wrap
def unpack(packed: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, N, D]: :func:`pack`'s inverse, zeros where ``real`` (bool [B, N]) does not hold."""
    index = torch.cumsum(real.flatten().long(), 0) - 1
    index = torch.where(real.flatten(), index, packed.shape[0])
    return F.pad(packed, (0, 0, 0, 1))[index].view(*real.shape, packed.shape[-1])


def _block(q, k, v, begin: int, keys: torch.Tensor, position_bias, num_buckets: int, time_bias, d, d_next):
    """``[r, c, H, dv]``: block ``[begin, begin + c)``'s queries ``q`` [r, c, H, dqk] over the
    keys ``k`` [r, e, H, dqk] / ``v`` [r, e, H, dv] (e = begin + c) of r sorted rows reading
    their first ``keys`` [r]; ``d`` [r, e], ``d_next`` [r, c] the time deltas (None: no time bias)."""
    c, e = q.shape[1], k.shape[1]
    i = torch.arange(begin, begin + c, device=q.device)[:, None]
    j = torch.arange(e, device=q.device)[None, :]
    bias = position_bias[position_bucket((i - j).clamp(min=0), num_buckets)][None, None]  # [1, 1, c, e]
    if time_bias is not None:  # rab^{p,t} = rab^p + rab^t, as the padded layer
        bias = bias + time_bias[hstu_time.time_bucket_of(d[:, None, :] - d_next[:, :, None], len(time_bias))][:, None]
    allowed = ((j <= i)[None] & (j[None] < keys[:, None, None])).to(q.dtype)  # [r, c, e]
    weight = allowed / allowed.sum(dim=2, keepdim=True).clamp(min=1)  # 1 / c_i, as target_layout
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) + bias
    att = F.silu(scores) * weight.unsqueeze(1)
    return torch.einsum("bhnm,bmhd->bnhd", att, v)


@torch.fx.wrap
def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lay: JaggedLayout,
    position_bias: torch.Tensor,
    deltas: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """HSTU's pointwise attention (``recsys_dist.models.hstu_attention``) of packed tokens.

    Args:
        q, k: [T, H, d_qk] packed queries and keys; v: [T, H, d_v].
        lay: the batch's :func:`layout`; a token at position i of its row reads positions
            ``j <= i`` with ``j`` below the row's ``keys``, each weighted ``1 / c_i``.
        position_bias: [num_buckets] ``rab^p``, of ``position_bucket(i - j)``.
        deltas: int64 [B, >= M - 1] each token's time delta ``d`` in the rows' original order,
            0 past the history (``hstu_time``); with ``time_bias`` [time_buckets] adds ``rab^t``.
        kernel: ``dense`` keeps every block's scores for backward; ``chunked`` recomputes each
            block in backward (``torch.utils.checkpoint``), keeping only its inputs; ``auto``:
            ``chunked`` from ``AUTO_RECOMPUTE_SCORES`` scores (``lay.pairs`` times the heads).

    Returns:
        [T, H * d_v] float, packed like ``q``.
    """
    width, batch = lay.width, lay.to_padded.shape[0]
    qkv = torch.cat([q, k, v], dim=-1)  # one gather for the three
    padded = F.pad(qkv.flatten(1), (0, 0, 0, 1))[lay.to_padded].view(batch, width, *qkv.shape[1:])
    q, k, v = padded.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
    d = d_next = None
    if time_bias is not None and deltas is not None:
        d = F.pad(deltas, (0, max(width - deltas.shape[1], 0)))[lay.order][:, :width]  # the token after: 0
        d_next = F.pad(d[:, 1:], (0, 1))
    else:
        time_bias = None
    recompute = kernel == "chunked" or (kernel == "auto" and lay.pairs * q.shape[-2] >= AUTO_RECOMPUTE_SCORES)
    recompute = recompute and torch.is_grad_enabled()
    parts = []
    for begin, r in zip(range(0, width, lay.block), lay.rows):
        end = min(begin + lay.block, width)
        args = (q[:r, begin:end], k[:r, :end], v[:r, :end], begin, lay.keys[:r], position_bias, len(position_bias))
        args += (time_bias, None if d is None else d[:r, :end], None if d is None else d_next[:r, begin:end])
        out = checkpoint(_block, *args, use_reentrant=False) if recompute else _block(*args)
        parts.append(F.pad(out, (0, 0, 0, 0, 0, 0, 0, batch - r)))  # the shorter rows' zeros
    out = torch.cat(parts, dim=1) if parts else v.new_zeros(batch, 0, *v.shape[2:])
    return out.flatten(2).flatten(0, 1)[lay.to_packed]
