"""The shared layer of the models over sequence features (EmbeddingCollection): DIN and BST
(``recsys_dist/models/zoo/din.py``, ``bst.py``).

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

# layers.pooled_embeddings, called through its module: torch.fx.wrap makes it a leaf of the
# pipeline's trace by patching that name in layers' namespace, which a name imported here would miss.
from recsys_dist.models import layers
from recsys_dist.models.config import ModelConfig


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
    (the subclass builds it, ``recsys_dist.models.layers.mlp_head``, after its own layers: the init
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
    def from_spec(cls, spec: FeatureSpec, cfg: ModelConfig, *args, **kwargs):
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
        v = layers.pooled_embeddings(self.sparse_arch(kjt), self.features)  # [B, F, E]
        target = v[:, self._target_index, :]
        out = self.seq_arch(kjt)
        parts = [dense, v.flatten(1)]
        for i, name in enumerate(self.sequences):
            values, mask = padded_sequence(out, name)
            parts.append(self.summarise(i, values, mask, target))
        return self.deep(torch.cat(parts, dim=1))
