"""Models over sequence features (EmbeddingCollection): DIN, BST.

A sequence feature's ids come in the same KeyedJaggedTensor as the pooled features; its table
lives in a ``torchrec.EmbeddingCollection``, whose output maps the feature to a JaggedTensor
with one embedding per position (``FeatureSpec.sequence_tables``). ``B`` = batch, ``L`` = the
longest sequence of the batch, ``E`` = embedding_dim.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsys_dist.data.spec import FeatureSpec

# ctr.pooled_embeddings, called through its module: torch.fx.wrap makes it a leaf of the
# pipeline's trace by patching that name in ctr's namespace, which a name imported here would miss.
from recsys_dist.models import ctr
from recsys_dist.models.ctr import mlp_head


# Leaves for torch.fx (TrainPipelineSparseDist traces the model): they read a dict, keys and
# shapes.
@torch.fx.wrap
def padded_sequence(out: dict[str, JaggedTensor], key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B, L, E] zero-padded after each sequence's end, mask [B, L] float 1/0) of one
    feature of an EmbeddingCollection's output; L = the batch's longest sequence, at least 1.

    The values always come from ``jt.values()`` through ``to_padded_dense``, also when every
    sequence of the batch is empty (a rank's share of a padded last batch, or a batch of
    first events): the sharded EmbeddingCollection's output_dist then gets its (empty)
    gradient in backward and runs its backward all-to-all like every other rank. Zeros made
    apart from the graph would skip that collective on this rank only, and the ranks would
    wait in different collectives until the process group's timeout. A padded position of
    mask 0 adds nothing: L = 1 for empty sequences gives the same summaries as L = 0."""
    jt = out[key]
    lengths = jt.lengths()
    longest = max(int(lengths.max()), 1) if lengths.numel() else 1
    values = jt.to_padded_dense(desired_length=longest)
    mask = (torch.arange(longest, device=lengths.device)[None, :] < lengths[:, None]).to(values.dtype)
    return values, mask


class TargetSequenceModel(nn.Module):
    """Shared by DIN and BST: pooled tables in ``ebc`` (one of them ``target_feature``), sequence
    tables in ``ec``; ``forward(dense [B, num_dense] float32, kjt)`` -> logits [B, 1] =
    ``deep([dense, e_1..e_F, summary of each sequence])``, with each sequence's summary
    ``summarise(i, values [B, L, E], mask [B, L], target [B, E])`` (the subclass's) and ``deep``
    (the subclass builds it, ``recsys_dist.models.ctr.mlp_head``, after its own layers: the init
    order, and so a seeded model's weights, follow the modules' order).

    Raises:
        ValueError: no sequence feature, or ``target_feature`` not a categorical feature.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        ec: EmbeddingCollection,
        features: list[str],
        sequences: list[str],
        target_feature: str,
    ) -> None:
        super().__init__()
        if target_feature not in features:
            raise ValueError(f"model.target_feature: {target_feature!r} is not a categorical feature ({features})")
        if not sequences:
            raise ValueError(
                f"{type(self).__name__} needs a sequence feature (data.schema.sequence or data.schema.history)"
            )
        self.sparse_arch, self.seq_arch = ebc, ec
        self.features, self.sequences = features, sequences
        self._target_index = features.index(target_feature)

    @classmethod
    def from_spec(cls, spec: FeatureSpec, cfg, *args, **kwargs):
        """``cls`` over ``spec``'s pooled tables (one EmbeddingBagCollection) and sequence tables
        (one EmbeddingCollection), with ``cfg``'s ``target_feature``, ``embedding_dim``,
        ``deep_layer_sizes`` and MLP options; ``args``/``kwargs``: the model's own."""
        return cls(
            EmbeddingBagCollection(tables=spec.all_tables(), device=spec.embedding_device),
            EmbeddingCollection(tables=spec.sequence_tables, device=spec.embedding_device),
            spec.num_dense,
            spec.sparse_names,
            spec.sequence_names,
            cfg.target_feature,
            cfg.embedding_dim,
            cfg.deep_layer_sizes,
            *args,
            device=spec.device,
            **kwargs,
            **cfg.mlp_kwargs(),
        )

    def summarise(self, i: int, values: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        v = ctr.pooled_embeddings(self.sparse_arch(kjt), self.features)  # [B, F, E]
        target = v[:, self._target_index, :]
        out = self.seq_arch(kjt)
        parts = [dense, v.flatten(1)]
        for i, name in enumerate(self.sequences):
            values, mask = padded_sequence(out, name)
            parts.append(self.summarise(i, values, mask, target))
        return self.deep(torch.cat(parts, dim=1))


class DIN(TargetSequenceModel):
    """Deep Interest Network (Zhou et al., 2018, KDD, arXiv:1706.06978), eq. 3 and Fig. 2.

    For each sequence feature with positions ``e_1..e_L`` [B, L, E] and the target item's
    embedding ``v_A`` [B, E] (the pooled embedding of ``target_feature``):

    ``w_j = a(e_j, v_A) = MLP_att([e_j, v_A, e_j - v_A, e_j * v_A])`` (the local activation
    unit; the paper's out-product is taken element-wise here, as in its public code), and
    ``v_U(A) = sum_j w_j e_j`` over real positions (eq. 3; no softmax, so the weights keep the
    intensity of the interest). Then ``logit = MLP([dense, e_1..e_F, v_U per sequence])``,
    with ``e_1..e_F`` the pooled embeddings of every sparse feature. An empty history gives
    ``v_U = 0``. Dice and the mini-batch-aware regulariser of the paper are not used
    (ReLU / PReLU-free MLP and the configured optimizers).
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
        attention_sizes: list[int],
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__(ebc, ec, features, sequences, target_feature)
        self.attention = nn.ModuleList(
            mlp_head(
                4 * embedding_dim, attention_sizes, device=device, activation=mlp_options.get("activation", "relu")
            )
            for _ in sequences
        )
        d = num_dense + (len(features) + len(sequences)) * embedding_dim
        self.deep = mlp_head(d, deep_layer_sizes, device=device, **mlp_options)

    def interest(self, att: nn.Module, values: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[B, E]: ``sum_j w_j e_j`` over real positions (eq. 3)."""
        t = target.unsqueeze(1).expand_as(values)
        w = att(torch.cat([values, t, values - t, values * t], dim=-1)).squeeze(-1) * mask  # [B, L]
        return (w.unsqueeze(-1) * values).sum(dim=1)

    def summarise(self, i: int, values: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.interest(self.attention[i], values, mask, target)


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
        self.transformers = nn.ModuleList(
            nn.Sequential(
                *(
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
            )
            for _ in sequences
        )
        d = num_dense + (len(features) + 2 * len(sequences)) * embedding_dim
        self.deep = mlp_head(d, deep_layer_sizes, device=device, **mlp_options)

    def encode(
        self,
        blocks: nn.Sequential,
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
