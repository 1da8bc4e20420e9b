"""Two-tower retrieval (Yi et al., 2019, "Sampling-Bias-Corrected Neural Modeling for Large
Corpus Item Recommendations", RecSys, doi:10.1145/3298689.3346996; towers as in Covington et
al., 2016, "Deep Neural Networks for YouTube Recommendations").

One EmbeddingBagCollection holds every categorical feature's table (sharded like any other
model's). The user tower reads the pooled embeddings of ``model.user_features``, the item
tower those of ``model.item_features``; each is an MLP (``tower_sizes``, then a linear layer to
``output_dim``) whose output is L2-normalised::

    u(x) = normalize(MLP_u([e_f(x)]_{f in user_features}))      [B, output_dim]
    v(y) = normalize(MLP_v([e_f(y)]_{f in item_features}))      [B, output_dim]
    s(x, y) = <u(x), v(y)> / temperature                         (a cosine over tau)

Training: an in-batch sampled softmax with the logQ correction (eq. 3 and 4 of Yi et al.),
``recsys_dist.models.losses.in_batch_softmax``: the other rows of the rank's batch are row i's
negatives, and ``s^c(x_i, y_j) = s(x_i, y_j) - log q_j`` with ``q_j`` the probability that item
j is in a batch. The paper estimates ``q`` by streaming (its Algorithm 2) because its corpus
and stream are unbounded; here the training split is fixed, so ``q_j`` is item j's exact share
of the training rows (``spec.id_counts``, counted by the Trainer; ``logq_correction: false``
trains without it).

Output: ``{"logits": s(x_i, y_i) [B], "candidate_scores": s(x_i, y_j) [B, B],
"candidate_ids": item ids [B], "candidate_log_q": log q [B]}``: ``logits`` (the pair score) is
what evaluation, ``predict`` and the AUC read; the rest is the loss's input (``CTRTask``).
Retrieval (recall@K / NDCG@K over the item corpus, ``recsys_dist.models.retrieval``) embeds users and
items separately with :meth:`TwoTower.user_vectors` and :meth:`TwoTower.item_vectors`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.checks import no_sequences, one_task
from recsys_dist.models.config import TwoTowerConfig
from recsys_dist.models.layers import mlp, pooled_embeddings
from recsys_dist.models.registry import register_model
from recsys_dist.models.retrieval import RETRIEVAL_HOOKS, retrieval_problems


# Leaves for torch.fx (TrainPipelineSparseDist traces forward and cannot read a KeyedTensor's
# layout or a KJT by key); torch.fx.wrap applies to names of this module.
@torch.fx.wrap
def _pooled(kt, keys: list[str]) -> torch.Tensor:
    """[B, len(keys) * E]: the pooled embeddings of ``keys``, concatenated in that order."""
    return pooled_embeddings(kt, keys).flatten(1)


@torch.fx.wrap
def _one_hot_ids(sparse: KeyedJaggedTensor, key: str) -> torch.Tensor:
    """int64 [B]: the id of one-hot feature ``key`` in each row."""
    return sparse[key].values().long()


class LogQ(nn.Module):
    """``log q`` of item ids: a non-persistent buffer ``log_q`` [num_items] (not in checkpoints
    or exports: the Trainer recomputes it from the training split), or zeros without one."""

    def __init__(self, log_q: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("log_q", log_q, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.log_q is None:
            return torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        return self.log_q[ids]


class TwoTower(nn.Module):
    """The two-tower network of the module docstring over one EmbeddingBagCollection.

    ``forward(dense float32 [B, D] (not read), kjt) -> dict`` (module docstring).
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        user_features: list[str],
        item_features: list[str],
        item_id: str,
        embedding_dim: int,
        tower_sizes: list[int],
        output_dim: int,
        temperature: float,
        log_q: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.sparse_arch = ebc
        self.user_features, self.item_features, self.item_id = list(user_features), list(item_features), item_id
        self.temperature = float(temperature)

        def tower(n: int) -> nn.Sequential:
            hidden = mlp(n * embedding_dim, tower_sizes, device=device)
            return nn.Sequential(
                hidden, nn.Linear(tower_sizes[-1] if tower_sizes else n * embedding_dim, output_dim, device=device)
            )

        self.user_tower, self.item_tower = tower(len(self.user_features)), tower(len(self.item_features))
        self.log_q = LogQ(log_q)

    def _user(self, kt) -> torch.Tensor:
        return F.normalize(self.user_tower(_pooled(kt, self.user_features)), dim=1)

    def _item(self, kt) -> torch.Tensor:
        return F.normalize(self.item_tower(_pooled(kt, self.item_features)), dim=1)

    def user_vectors(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """float32 [B, output_dim], unit norm: the user tower on the user features of ``kjt``
        (a KJT with every feature of the EmbeddingBagCollection; the item ones may be empty)."""
        return self._user(self.sparse_arch(kjt))

    def item_vectors(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """float32 [B, output_dim], unit norm: the item tower on the item features of ``kjt``."""
        return self._item(self.sparse_arch(kjt))

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        kt = self.sparse_arch(kjt)  # one lookup (one input_dist / output_dist) serves both towers
        u, v = self._user(kt), self._item(kt)
        ids = _one_hot_ids(kjt, self.item_id)
        # A dict literal (not a leaf's output): under the pipeline's fx trace each entry is its own node.
        return {
            "logits": (u * v).sum(dim=1) / self.temperature,  # s(x_i, y_i)
            "candidate_scores": torch.matmul(u, v.t()) / self.temperature,  # s(x_i, y_j)
            "candidate_ids": ids,
            "candidate_log_q": self.log_q(ids),
        }


def log_q_of(counts: torch.Tensor) -> torch.Tensor:
    """float32 ``log q``: ``log(count / total)`` per id, with a count of 0 read as 1 (an id never
    in training is never an in-batch candidate either; this keeps the log finite)."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    return (c.clamp(min=1) / c.sum().clamp(min=1)).log().float()


@register_model("two_tower", TwoTowerConfig, checks=(one_task, no_sequences, retrieval_problems), **RETRIEVAL_HOOKS)
def build_two_tower(spec: FeatureSpec, cfg: TwoTowerConfig) -> TwoTower:
    """``TwoTower`` over the spec's tables; ``log q`` from ``spec.id_counts[item_id]`` when
    ``logq_correction`` and the counts are there (a model built for scoring has none: its
    pair scores do not use them).

    Raises:
        ValueError: a tower feature that is not a categorical feature of the data.
    """
    items = cfg.item_feature_names(spec.sparse_names)
    unknown = [f for f in [*cfg.user_features, *items] if f not in spec.sparse_names]
    if unknown or not items:
        raise ValueError(
            f"model: two_tower features {unknown or 'item_features (none left)'} are not categorical features "
            f"of the data; they are {spec.sparse_names}"
        )
    counts = spec.id_counts.get(cfg.item_id) if cfg.logq_correction else None
    return TwoTower(
        EmbeddingBagCollection(tables=spec.tables, device=spec.embedding_device),
        cfg.user_features,
        items,
        cfg.item_id,
        cfg.embedding_dim,
        cfg.tower_sizes,
        cfg.output_dim,
        cfg.temperature,
        log_q=log_q_of(counts).to(spec.device) if counts is not None else None,
        device=spec.device,
    )
