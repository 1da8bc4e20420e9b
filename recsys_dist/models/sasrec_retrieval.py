"""SASRec (Kang & McAuley, 2018, "Self-Attentive Sequential Recommendation") as an encoder of
:class:`recsys_dist.models.hstu_retrieval.HSTURetrieval`: the same item table, batches, sampled
softmax and retrieval, SASRec's layers in place of HSTU's. The baseline of
``benchmarks/hstu_retrieval.py``, written as the HSTU reference trains it
(the generative-recommenders repository's research SASRec module with its ML-1M config
``sasrec-sampled-softmax-n128-final.gin``):

- input: ``e_i * sqrt(D) + p_i`` with ``p_i`` a learned embedding of the position counted
  from the sequence's FIRST item (i = 0, 1, ...; truncated normal, std ``sqrt(1 / D)``), input
  dropout, padded positions zeroed;
- each block (the original SASRec's): ``q = LN(x)``; ``a = softmax(q K^T / sqrt(d) + causal)
  V`` with keys and values from ``x`` (one ``nn.MultiheadAttention``, dropout on the
  attention weights); ``h = LN(q + a)``; ``x = (h + FF(h)) * mask`` with ``FF`` = linear, ReLU,
  dropout, linear, dropout (hidden width D); layer norms without a learned scale (eps 1e-8);
  weight matrices xavier-normal;
- output: the last block's rows, L2-normalised (no final layer norm, as the reference).

Positions count from the first item, not back from the last: training reads the query of
position i to predict item i + 1, so the position of a sequence's last item is never a training
query; counted back from the end, that position (0) would be the one retrieval reads and the
one training never updates. Counted from the start, a history's user vector is exactly the
training query that predicts its next item (tests/unit/models/test_sasrec_retrieval.py).

Padding: sequences are padded after their end (``recsys_dist.models.sequence.padded_sequence``),
so the causal mask alone keeps every real query off the padded keys, and every query (a padded
one too) reads at least key 0: no row is fully masked, no NaN.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torchrec.modules.embedding_modules import EmbeddingCollection

from recsys_dist.models.hstu_retrieval import HSTURetrieval

LN_EPS = 1e-8


# A torch.fx leaf (TrainPipelineSparseDist traces the forward): it reads a shape and may raise.
@torch.fx.wrap
def position_ids(values: torch.Tensor, max_length: int) -> torch.Tensor:
    """int64 [N]: ``0 .. N - 1`` for ``values`` [B, N, D]. Raises ValueError when N > ``max_length``."""
    n = values.shape[1]
    if n > max_length:
        raise ValueError(f"SASRecRetrieval: a sequence of {n} items, longer than max_length={max_length}")
    return torch.arange(n, device=values.device)


class SASRecBlock(nn.Module):
    """One SASRec block over ``x`` [B, N, D] (module docstring); ``forward(x, causal [N, N] bool,
    True = not read, mask [B, N] float)`` -> [B, N, D], padded rows zero."""

    def __init__(self, dim: int, num_heads: int, dropout: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.dim = dim
        self.attention = nn.MultiheadAttention(dim, num_heads, dropout=dropout, batch_first=True, device=device)
        self.feed_forward = nn.Sequential(
            nn.Linear(dim, dim, device=device),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(dim, dim, device=device),
            nn.Dropout(dropout),
        )
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)

    def forward(self, x: torch.Tensor, causal: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = F.layer_norm(x, (self.dim,), eps=LN_EPS)
        a = self.attention(q, x, x, attn_mask=causal, need_weights=False)[0]
        h = F.layer_norm(q + a, (self.dim,), eps=LN_EPS)
        return (h + self.feed_forward(h)) * mask.unsqueeze(-1)


class SASRecRetrieval(HSTURetrieval):
    """:class:`HSTURetrieval` (its ``forward``, ``user_vectors``, ``item_vectors``) with the SASRec
    encoder of the module docstring: ``num_layers`` blocks of ``num_heads`` heads over D =
    ``embedding_dim``, positions ``0 .. max_length - 1``; parameters made on ``device`` (None: CPU).

    Raises:
        ValueError: (from ``encode``) a batch longer than ``max_length`` items.
    """

    def __init__(
        self,
        ec: EmbeddingCollection,
        embedding_dim: int,
        num_layers: int,
        num_heads: int,
        dropout: float,
        max_length: int,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(ec, embedding_dim, num_layers=0, dropout=dropout, device=device)
        self.max_length = max_length
        # A parameter indexed directly, not an nn.Embedding: no sharder covers that (it is small, data-parallel).
        self.positions = nn.Parameter(torch.empty(max_length, embedding_dim, device=device))
        std = math.sqrt(1.0 / embedding_dim)
        nn.init.trunc_normal_(self.positions, std=std, a=-2 * std, b=2 * std)
        self.blocks = nn.ModuleList(SASRecBlock(embedding_dim, num_heads, dropout, device) for _ in range(num_layers))

    def encode(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, N, D] unit rows: the outputs of the padded items ``values`` [B, N, D] (mask [B, N],
        each row's real items first)."""
        idx = position_ids(values, self.max_length)
        x = self.input_dropout(values * math.sqrt(self.dim) + self.positions[idx][None]) * mask.unsqueeze(-1)
        causal = idx[None, :] > idx[:, None]  # query i does not read key j > i
        for block in self.blocks:
            x = block(x, causal, mask)
        return F.normalize(x, dim=-1)
