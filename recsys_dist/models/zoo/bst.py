"""BST (Chen et al., 2019, arXiv:1905.06874): a transformer over the user's history plus the target.

The module and its equations: :class:`BST`. Pooled tables in one
EmbeddingBagCollection, sequence tables in one EmbeddingCollection: both sharded.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.checks import no_history_extras, one_task
from recsys_dist.models.config import BSTConfig
from recsys_dist.models.layers import mlp_head
from recsys_dist.models.registry import register_model
from recsys_dist.models.sequence import TargetSequenceModel


@torch.fx.wrap
def recency(mask: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, 1 + L] int64, padding [B, 1 + L] bool) of the sequence ``[target, h_1..h_L]``
    whose history has the real-position ``mask`` [B, L] (1 then 0): the target is position 0,
    ``h_j`` of a row with n real positions ``n - j + 1`` (1 = the most recent), capped at
    ``max_positions - 1``; padding is True after each row's end (its position, 0, is unused)."""
    first = mask.new_ones(mask.shape[0], 1)  # the target: always real
    from_end = mask.flip(1).cumsum(1).flip(1)  # n - j + 1 at real positions, 0 after the end
    pos = torch.cat([first - 1, from_end], dim=1).clamp(max=max_positions - 1).long()
    return pos, torch.cat([first, mask], dim=1) == 0


class BST(TargetSequenceModel):
    """Behavior Sequence Transformer (Chen et al., 2019, DLP-KDD, arXiv:1905.06874), Fig. 1.

    For each sequence feature with positions ``h_1..h_L`` [B, L, E] (oldest first) and the target
    item's embedding ``v_A`` [B, E] (the pooled embedding of ``target_feature``), the transformer
    reads the sequence ``x = [v_A, h_1..h_n]`` plus a learned positional embedding
    ``p_k`` (a [max_positions, E] parameter) per position:

    ``E_k = x_k + p_{pos(k)}``, ``pos = 0`` for the target and ``n - j + 1`` for ``h_j`` (recency:
    1 = the most recent event), capped at ``max_positions - 1``. The paper's position is the
    bucketed time difference ``t(v_A) - t(h_j)``; the data carry no per-event time, so the rank
    in time stands for it.

    Then ``num_blocks`` post-norm transformer encoder layers (eq. 1-5):
    ``S = MH(E) = Concat(head_1..head_h) W^O``, ``head_i = softmax(E W_i^Q (E W_i^K)^T / sqrt(E/h))
    E W_i^V`` over the real positions only (padding is masked out of the keys);
    ``S' = LayerNorm(E + Dropout(S))``; ``F = LayerNorm(S' + Dropout(W^2 Dropout(LeakyReLU(W^1 S'
    + b^1)) + b^2))`` (``torch.nn.TransformerEncoderLayer``). The output ``F`` [B, 1 + L, E] is
    pooled per sequence (the paper flattens it, which needs a fixed length) into ``[F_0, mean_j
    F_j]``: the target's position (which attended to the history) and the mean over the real
    history positions (0 for an empty history). Then ``logit = MLP([dense, e_1..e_F, (F_0,
    mean F_j) per sequence])``, with ``e_1..e_F`` the pooled embeddings of every sparse feature.

    ``forward(dense [B, num_dense] float32, kjt)`` returns logits [B, 1].

    Raises:
        ValueError: no sequence feature, ``target_feature`` not a categorical feature, or
            ``num_heads`` not dividing ``embedding_dim``.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        ec: EmbeddingCollection,
        num_dense: int,
        features: list[str],
        sequences: list[str],
        target_feature: str,
        embedding_dim: int,
        deep_layer_sizes: list[int],
        num_heads: int = 2,
        ffn_size: int = 64,
        num_blocks: int = 1,
        transformer_dropout: float = 0.1,
        max_positions: int = 64,
        position_init_scale: float = 0.05,
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__(ebc, ec, features, sequences, target_feature)
        if embedding_dim % num_heads:
            raise ValueError(f"model.num_heads: {num_heads} does not divide model.embedding_dim {embedding_dim}")
        self.max_positions = max_positions
        self.positions = nn.ParameterList(
            nn.Parameter(torch.empty(max_positions, embedding_dim, device=device).uniform_(-1, 1) * position_init_scale)
            for _ in sequences
        )
        # A ModuleList per history, not a Sequential: its layers are called one by one (with the
        # padding mask), so each is a block of its own under distributed.dense.strategy: fsdp, whose
        # weights are gathered in that layer's forward (a Sequential, never called, would be one block
        # gathered by no one). The same state-dict keys either way.
        self.transformers = nn.ModuleList(
            nn.ModuleList(
                nn.TransformerEncoderLayer(
                    embedding_dim,
                    num_heads,
                    dim_feedforward=ffn_size,
                    dropout=transformer_dropout,
                    activation=nn.functional.leaky_relu,
                    batch_first=True,
                    device=device,
                )
                for _ in range(num_blocks)
            )
            for _ in sequences
        )
        d = num_dense + (len(features) + 2 * len(sequences)) * embedding_dim
        self.deep = mlp_head(d, deep_layer_sizes, device=device, **mlp_options)

    def encode(
        self,
        blocks: nn.ModuleList,
        positions: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """[B, 2E]: ``[F_0, mean of F_j over the real history positions]`` for one sequence."""
        pos, padding = recency(mask, self.max_positions)
        out = torch.cat([target.unsqueeze(1), values], dim=1) + positions[pos]  # [B, 1 + L, E]
        for block in blocks:
            out = block(out, src_key_padding_mask=padding)
        hist = (out[:, 1:, :] * mask.unsqueeze(-1)).sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return torch.cat([out[:, 0, :], hist], dim=1)

    def summarise(self, i: int, values: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.encode(self.transformers[i], self.positions[i], values, mask, target)


@register_model("bst", BSTConfig, checks=(one_task, no_history_extras))
def build_bst(spec: FeatureSpec, cfg: BSTConfig) -> BST:
    """``BST`` over the spec's pooled tables and its sequence tables; the positional embeddings
    start uniform in ``[-embedding_init_scale, embedding_init_scale]`` (0.05 when None).

    Raises:
        ValueError: no sequence feature, or ``target_feature`` is not a categorical feature.
    """
    return BST.from_spec(
        spec,
        cfg,
        num_heads=cfg.num_heads,
        ffn_size=cfg.ffn_size,
        num_blocks=cfg.num_blocks,
        transformer_dropout=cfg.transformer_dropout,
        max_positions=cfg.max_positions,
        position_init_scale=cfg.embedding_init_scale or 0.05,
    )
