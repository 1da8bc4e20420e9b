"""HSTU's relative time bias ``rab^t`` (Zhai et al., 2024, Section 3.1: ``rab^{p,t}``), the bucket
of each (query, key) pair; the learned scalar per bucket lives in each ``HSTULayer``.

As the reference (facebookresearch/generative-recommenders,
``generative_recommenders/modeling/sequential/hstu.py``, ``RelativeBucketedTimeAndPositionBasedBias``
with the bucketization ``(log(|dt|.clamp(min=1)) / 0.301).long()`` of its training script):
query ``i`` reads key ``j`` with the bias of ``bucket(t_next(i) - t_j)``, where ``t_next(i)`` is
the time of the token after ``i`` (the last token's own time), and

    bucket(dt) = min(floor(ln(max(|dt|, 1)) / 0.301), num_buckets - 1).

Here the tokens are ``[h_1..h_n, target]`` and each history event comes with
``d_j = t_target - t_j >= 0`` (``data.schema.history.times``: the row's time minus the event's, whole
units of the time column); the target's own is 0. So ``t_next(i) - t_j = d_j - d_{i+1}``
(``d_{n+1} = 0``: the last event's next token is the target, and the target's is itself).
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

LOG_STEP = 0.301  # the reference's divisor of ln(dt): log10(2), as written there


def time_bucket_of(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """int64, same shape: ``min(floor(ln(max(|dt|, 1)) / 0.301), num_buckets - 1)`` of time
    differences ``dt`` (int64, the time column's units); computed in float64, so a loop with
    ``math.log`` gets the same buckets."""
    logs = torch.log(dt.abs().clamp(min=1).to(torch.float64)) / LOG_STEP
    return torch.floor(logs).long().clamp(max=num_buckets - 1)


# Leaves for torch.fx (TrainPipelineSparseDist traces the model): they read a KJT and shapes.
@torch.fx.wrap
def padded_deltas(kjt: KeyedJaggedTensor, key: str, mask: torch.Tensor) -> torch.Tensor:
    """int64 [B, L]: the raw-valued feature ``key`` (``1 + d`` per event,
    ``FeatureSpec.value_names``) as ``d``, zero after each row's events; ``mask`` [B, L] the
    history's (``sequence.padded_sequence``).

    Raises:
        ValueError: a row's count of times is not its count of events.
    """
    jt, length = kjt[key], mask.shape[1]
    if not torch.equal(jt.lengths().long(), mask.sum(dim=1).long()):
        raise ValueError(f"{key}: rows' counts of times {jt.lengths().tolist()} are not their counts of events")
    return (jt.to_padded_dense(desired_length=length, padding_value=1) - 1).long()


@torch.fx.wrap
def time_buckets(deltas: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """int64 [B, N, N], N = L + 1: the time bucket of query i, key j over the tokens
    ``[h_1..h_L, target]`` given each event's ``d_j`` (``deltas`` int64 [B, L], 0 on padding):
    ``time_bucket_of(d_j - d_next(i))`` with ``d_next(i) = d_{i+1}`` and 0 for the target and the
    last real event (padding's 0 follows it)."""
    batch = deltas.shape[0]
    zero = deltas.new_zeros(batch, 1)
    d = torch.cat([deltas, zero], dim=1)  # [B, N]: the target's own is 0
    d_next = torch.cat([deltas[:, 1:], zero, zero], dim=1)  # [B, N]
    return time_bucket_of(d[:, None, :] - d_next[:, :, None], num_buckets)
