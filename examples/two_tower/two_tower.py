"""A two-tower retrieval model and its in-batch softmax loss, written against recsys_dist's
public model contract (docs/api.md) and named by import path in ``config.yaml``.

Two towers (Covington et al., 2016, "Deep Neural Networks for YouTube Recommendations";
Yi et al., 2019, "Sampling-Bias-Corrected Neural Modeling for Large Corpus Item
Recommendations", RecSys '19): the user tower maps the user's features, the item tower the
item's, each to an L2-normalised vector; their dot product over a temperature scores a pair.
Training is a softmax over the items of the batch (every other row's item is a negative),
optionally with the logQ correction of Yi et al. eq. 3: ``s(u_i, v_j) - log q_j``, with
``q_j`` the item's frequency in the training split, so that popular items, which are
negatives more often, are not pushed down for it.

How it fits the Trainer: the model returns one value per row. In training mode that value
is the row's log-probability of its own item among the batch's items (eq. 3 and 4 of Yi et
al.); ``in_batch_softmax`` averages its negative over the positive rows. In eval mode it is
the pair's score ``<u, v> / temperature``, so ``Trainer.evaluate`` reports the AUC of scoring
a user's liked movies above the ones they rated lower, and ``predict`` gives pair scores.
For retrieval, :meth:`TwoTower.user_vectors` and :meth:`TwoTower.item_vectors` embed users and
the item corpus separately (``train.py``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor


# TrainPipelineSparseDist traces forward with torch.fx: reading a KeyedTensor or a
# KeyedJaggedTensor by key must happen inside a function the trace keeps as a leaf.
@torch.fx.wrap
def pooled(kt: KeyedTensor, keys: list[str]) -> torch.Tensor:
    """[B, len(keys) * E]: the pooled embeddings of ``keys``, concatenated in that order."""
    per_key = kt.to_dict()
    return torch.cat([per_key[k] for k in keys], dim=1)


@torch.fx.wrap
def one_hot_ids(sparse: KeyedJaggedTensor, key: str) -> torch.Tensor:
    """int64 [B]: the id of one-hot feature ``key`` in each row."""
    return sparse[key].values()


def mlp(sizes: list[int], device: torch.device) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b, device=device))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class InBatchSoftmax(nn.Module):
    """Scores of the batch's rows: training, ``log softmax_j(s_ij - log q_j)`` at ``j = i``
    (float32 [B]); eval, ``s_ii`` (float32 [B]), with ``s_ij = <u_i, v_j> / temperature``.

    Another row holding the same item as row i is not a negative of row i (it is the same
    item; "accidental hits"). No tables: the fx trace keeps this module a leaf, so it may
    branch on ``self.training``.
    """

    def __init__(self, temperature: float, log_q: torch.Tensor | None) -> None:
        super().__init__()
        self.temperature = temperature
        self.register_buffer("log_q", log_q, persistent=False)

    def forward(self, u: torch.Tensor, v: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return (u * v).sum(dim=1) / self.temperature
        scores = u @ v.T / self.temperature  # [B, B]: user i against item j
        if self.log_q is not None:
            scores = scores - self.log_q[item].unsqueeze(0)  # eq. 3: the same correction for column j
        same = item.unsqueeze(0) == item.unsqueeze(1)
        same.fill_diagonal_(False)
        scores = scores.masked_fill(same, float("-inf"))
        return scores.diagonal() - torch.logsumexp(scores, dim=1)


class TwoTower(nn.Module):
    """User tower over ``user_features``, item tower over the other categorical features.

    Args:
        spec: the run's ``recsys_dist.FeatureSpec``; one table per categorical feature
            (``spec.tables``), all in one EmbeddingBagCollection.
        user_features: the features of the user tower; the rest go to the item tower.
        item_id: the one-hot feature naming the item (for the logQ correction and for
            masking repeats of an item in a batch).
        hidden: width of each tower's hidden layer; out_dim: width of the towers' output.
        temperature: divides the cosine similarity (0.05-0.1 is usual for normalised towers).
        item_counts: None (no logQ correction) or a ``.npy`` file of int64 counts, one per
            row of the item table (its training-split frequency); see ``train.py``.
    """

    def __init__(
        self,
        spec,
        user_features: tuple[str, ...] | list[str] = ("userId",),
        item_id: str = "movieId",
        hidden: int = 64,
        out_dim: int = 32,
        temperature: float = 0.1,
        item_counts: str | None = None,
    ) -> None:
        super().__init__()
        self.user_keys = [f for f in spec.sparse_names if f in user_features]
        self.item_keys = [f for f in spec.sparse_names if f not in user_features]
        if not self.user_keys or item_id not in self.item_keys:
            raise ValueError(f"TwoTower: user_features {list(user_features)} and item_id {item_id!r} must be features")
        self.item_id = item_id
        dim = spec.embedding_dim
        self.ebc = EmbeddingBagCollection(tables=spec.tables, device=spec.embedding_device)
        self.user_mlp = mlp([dim * len(self.user_keys), hidden, out_dim], spec.device)
        self.item_mlp = mlp([dim * len(self.item_keys), hidden, out_dim], spec.device)
        log_q = None
        if item_counts is not None:
            counts = torch.as_tensor(np.load(item_counts), dtype=torch.float64)
            rows = spec.num_embeddings[spec.sparse_names.index(item_id)]
            if counts.shape != (rows,):
                raise ValueError(f"TwoTower: {item_counts} holds {tuple(counts.shape)} counts, the table {rows} rows")
            # An item never seen in training is never a negative either; clamp keeps log finite.
            log_q = (counts.clamp(min=1) / counts.sum()).log().float().to(spec.device)
        self.head = InBatchSoftmax(temperature, log_q)

    def user_vectors(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """float32 [B, out_dim], unit norm: the user tower on the user features of ``sparse``."""
        return F.normalize(self.user_mlp(pooled(self.ebc(sparse), self.user_keys)), dim=1)

    def item_vectors(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """float32 [B, out_dim], unit norm: the item tower on the item features of ``sparse``."""
        return F.normalize(self.item_mlp(pooled(self.ebc(sparse), self.item_keys)), dim=1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        kt = self.ebc(sparse)  # one lookup serves both towers
        u = F.normalize(self.user_mlp(pooled(kt, self.user_keys)), dim=1)
        v = F.normalize(self.item_mlp(pooled(kt, self.item_keys)), dim=1)
        return self.head(u, v, one_hot_ids(sparse, self.item_id))  # [B]


def in_batch_softmax(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, positives_only: bool = True
) -> torch.Tensor:
    """Sampled softmax loss over in-batch negatives: the mean of ``-log p(item_i | user_i)``
    (``logits``, float32 [B], from :class:`InBatchSoftmax` in training mode) over the rows
    that are positives (``labels`` 1; every row with ``positives_only=False``); padding rows
    (``weights`` 0) never count. A scalar; 0 for a batch without positives."""
    w = weights * labels if positives_only else weights
    return -(logits * w).sum() / w.sum().clamp(min=1.0)
