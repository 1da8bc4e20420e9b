"""Models over sequence features (EmbeddingCollection): DIN.

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

from recsys_dist.models.ctr import mlp, pooled_embeddings


# Leaves for torch.fx (TrainPipelineSparseDist traces the model): they read a dict, keys and
# shapes. torch.fx.wrap applies to names of the module that calls it, hence the local twin.
@torch.fx.wrap
def pooled(kt, keys: list[str]) -> torch.Tensor:
    """[B, F, E] pooled embeddings of ``keys`` (``recsys_dist.models.ctr.pooled_embeddings``)."""
    return pooled_embeddings(kt, keys)


@torch.fx.wrap
def padded_sequence(out: dict[str, JaggedTensor], key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B, L, E] zero-padded after each sequence's end, mask [B, L] float 1/0) of one
    feature of an EmbeddingCollection's output; L = the batch's longest sequence (0 when all
    are empty)."""
    jt = out[key]
    lengths = jt.lengths()
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest:
        values = jt.to_padded_dense(desired_length=longest)
    else:  # every sequence of the batch is empty
        values = jt.values().new_zeros(lengths.numel(), 0, jt.values().shape[-1])
    mask = (torch.arange(longest, device=lengths.device)[None, :] < lengths[:, None]).to(values.dtype)
    return values, mask


class DIN(nn.Module):
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
        super().__init__()
        if target_feature not in features:
            raise ValueError(f"model.target_feature: {target_feature!r} is not a categorical feature ({features})")
        if not sequences:
            raise ValueError("DIN needs a sequence feature (data.schema.sequence or data.schema.history)")
        self.sparse_arch, self.seq_arch = ebc, ec
        self.features, self.sequences, self.target = features, sequences, target_feature
        self._target_index = features.index(target_feature)
        self.attention = nn.ModuleList(
            nn.Sequential(
                mlp(
                    4 * embedding_dim, attention_sizes, device=device, activation=mlp_options.get("activation", "relu")
                ),
                nn.Linear(attention_sizes[-1], 1, device=device),
            )
            for _ in sequences
        )
        d = num_dense + (len(features) + len(sequences)) * embedding_dim
        self.deep = nn.Sequential(
            mlp(d, deep_layer_sizes, device=device, **mlp_options), nn.Linear(deep_layer_sizes[-1], 1, device=device)
        )

    def interest(self, att: nn.Module, values: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[B, E]: ``sum_j w_j e_j`` over real positions (eq. 3)."""
        t = target.unsqueeze(1).expand_as(values)
        w = att(torch.cat([values, t, values - t, values * t], dim=-1)).squeeze(-1) * mask  # [B, L]
        return (w.unsqueeze(-1) * values).sum(dim=1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        v = pooled(self.sparse_arch(kjt), self.features)  # [B, F, E]
        target = v[:, self._target_index, :]
        out = self.seq_arch(kjt)
        parts = [dense, v.flatten(1)]
        for att, name in zip(self.attention, self.sequences):
            values, mask = padded_sequence(out, name)
            parts.append(self.interest(att, values, mask, target))
        return self.deep(torch.cat(parts, dim=1))
