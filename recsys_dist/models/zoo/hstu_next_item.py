"""``model.name: hstu_retrieval``: HSTU next-item retrieval (Zhai et al., 2024, Section 4.1)
trained and evaluated by the Trainer from YAML (docs/models.md, "Retrieval: HSTU next-item").

Data: ``data.format: schema`` with a user history (``data.schema.history``: per row, the items
of the same user's strictly earlier rows, the last ``max_length``) and the row's item as the one
categorical feature ``model.item_id`` (the history's ``item`` column). Each training row is one
next-item event: its history predicts its item, so the rows of a user together give the
reference's autoregressive loss over that user's positions (each context cut to
``max_length``).

One id space: ``data.categorical_mapping: hash`` gives a value the same id in the item table and
in the history's table (``1 + key mod (n - 1)`` of the value's 64-bit key, both tables of one
size); the model reads both features from ONE table (the history's ``s_<history>``, sharded
like any sequence table), as the reference shares input and output embeddings. Two items whose
keys share a row are one item (the conversion reports shared rows, docs/data.md). A vocabulary
gives the two columns different ids, so it is refused (preflight).

The network is :class:`recsys_dist.models.hstu_retrieval.HSTURetrieval`'s (its ``encode``):
``u = y_n``, the last real position's output (unit norm), ``v = normalize(e_item)``; training is
the in-batch sampled softmax with the logQ correction (``train.loss: in_batch_softmax``, the
two-tower's loss; the library's uniform negatives need ids the data loader does not carry).
A row without history (a user's first event) trains the empty history's vector.

Evaluation (the ``evaluator`` hook, every ``eval`` of validation and test): each held-out row
with a non-empty history is a target ranked against ALL items of the data (every distinct
item id of the three splits), less the items of its own history, by
``recsys_dist.models.next_item.target_ranks`` and ``ranking_metrics`` (HR@K, NDCG@K for K of
``eval.retrieval_k``, MRR). Under ``data.split.by: leave_last_out`` (with
``data.schema.history.ties: file_order``) the held-out rows are each user's last two events
and these are the leave-last-out protocol's numbers (``next_item.leave_last_out``); under
another split (e.g. by time) a user may have several held-out rows, each scored after its
own history.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.spec import FeatureSpec

# sequence.padded_sequence through its module: a torch.fx leaf only under its own module's name.
from recsys_dist.models import sequence
from recsys_dist.models.checks import no_history_extras
from recsys_dist.models.config import HSTURetrievalConfig, NextItemConfig
from recsys_dist.models.hstu_retrieval import HSTURetrieval
from recsys_dist.models.next_item import DEFAULT_K, ranking_metrics, target_ranks
from recsys_dist.models.registry import register_model
from recsys_dist.models.retrieval import SPLITS, candidate_loss_problems, read_rows
from recsys_dist.models.zoo.two_tower import LogQ, log_q_of


# Leaves for torch.fx (TrainPipelineSparseDist traces forward): they read shapes and a KJT by key.
@torch.fx.wrap
def _last(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, D]: ``y [B, N, D]`` at each row's last real position (position 0 for an empty row)."""
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    return y[torch.arange(y.shape[0], device=y.device), last]


@torch.fx.wrap
def _item_ids(kjt: KeyedJaggedTensor, key: str) -> torch.Tensor:
    """int64 [B]: the one-hot feature ``key``'s id per row."""
    return kjt[key].values().long()


class HSTUNextItem(HSTURetrieval):
    """HSTURetrieval over the data's KJT (keys ``keys``: the item feature, then the history),
    one table read by both. ``forward(dense (not read), kjt)`` returns ``{"logits": <u_i, v_i> /
    temperature [B], "candidate_scores": u_i . v_j / temperature [B, B], "candidate_ids": item
    ids [B], "candidate_log_q": log q [B]}`` (float32; ``in_batch_softmax``'s inputs)."""

    def __init__(self, ec, keys, item, history, temperature, log_q=None, **layers) -> None:
        super().__init__(ec, **layers)
        self.keys, self.item, self.history = list(keys), item, history
        self.temperature = float(temperature)
        self.log_q = LogQ(log_q)

    def _users(self, out) -> torch.Tensor:
        values, mask = sequence.padded_sequence(out, self.history)
        return _last(self.encode(values, mask), mask)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        out = self.seq_arch(kjt)  # one lookup serves the history and the items
        u = self._users(out)
        v = F.normalize(sequence.padded_sequence(out, self.item)[0][:, 0], dim=-1)
        ids = _item_ids(kjt, self.item)
        return {
            "logits": (u * v).sum(dim=1) / self.temperature,
            "candidate_scores": torch.matmul(u, v.t()) / self.temperature,
            "candidate_ids": ids,
            "candidate_log_q": self.log_q(ids),
        }

    def _kjt(self, item_ids: np.ndarray, item_lengths, histories: list[np.ndarray]) -> KeyedJaggedTensor:
        lengths = {self.item: item_lengths, self.history: [len(h) for h in histories]}
        parts = {self.item: item_ids, self.history: np.concatenate([np.zeros(0, np.int64), *histories])}
        return KeyedJaggedTensor.from_lengths_sync(
            self.keys,
            torch.as_tensor(np.concatenate([np.asarray(parts[k], np.int64) for k in self.keys])),
            torch.as_tensor(np.concatenate([np.asarray(lengths[k], np.int64) for k in self.keys]), dtype=torch.int32),
        )

    def user_vectors(self, histories: list[np.ndarray]) -> torch.Tensor:
        """float32 [B, D], unit rows: ``y_n`` of each history (table ids, oldest first, not empty)."""
        n = len(histories)
        return self._users(self.seq_arch(self._kjt(np.zeros(0, np.int64), np.zeros(n), histories)))

    def item_vectors(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [N, D], unit rows: the normalised table rows of ``ids`` (int64 [N])."""
        ids = np.asarray(ids, np.int64)
        out = self.seq_arch(self._kjt(ids, np.ones(len(ids)), [np.zeros(0, np.int64)] * len(ids)))
        return F.normalize(out[self.item].values(), dim=-1)


@dataclass
class NextItemData:
    """Read once from the converted splits. ``catalogue``: int64 [C], every distinct item id of
    the three splits (table ids, ascending, 0 = missing left out); ``train_counts``: int64
    [table rows], training rows per item id; per held-out split, ``histories`` (table ids,
    oldest first, rows with a history only) and ``targets`` (int64); ``skipped``: that split's
    rows without history or item."""

    catalogue: np.ndarray
    train_counts: np.ndarray
    item: str
    histories: dict[str, list[np.ndarray]]
    targets: dict[str, np.ndarray]
    skipped: dict[str, int]


def read_next_item_data(job, paths: dict[str, list[str]]) -> NextItemData:
    """:class:`NextItemData` of the converted splits ``paths`` (``{split: files}``).

    Raises:
        ValueError: a history id that is no row's item (the history and the item are not in one
            id space: not the hash mapping of one table size).
    """
    m, features = job.model, job.features
    history = features.sequence_names[0]
    rows = {s: read_rows(paths[s], features) for s in SPLITS}
    items = {s: r.one_hot(m.item_id) for s, r in rows.items()}
    catalogue = np.unique(np.concatenate(list(items.values())))
    catalogue = catalogue[catalogue > 0]
    size = features.tables[features.sparse_names.index(m.item_id)].num_embeddings
    out = NextItemData(catalogue, np.bincount(items["train"], minlength=size)[:size], m.item_id, {}, {}, {})
    for s, r in rows.items():
        lengths, values = r.ids[history]
        foreign = np.setdiff1d(values, catalogue)
        if len(foreign):
            raise ValueError(
                f"data.schema.history: the {s} split's history holds id {int(foreign[0])}, which no row's "
                f"{m.item_id} has: the history and the item are not in one id space (use "
                "data.categorical_mapping: hash, one num_embeddings for both)"
            )
        if s == "train":
            continue
        seqs = np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []
        keep = [i for i, h in enumerate(seqs) if len(h) and items[s][i] > 0]
        out.histories[s], out.targets[s] = [seqs[i] for i in keep], items[s][keep]
        out.skipped[s] = len(seqs) - len(keep)
    return out


def with_item_counts(spec: FeatureSpec, data: NextItemData) -> FeatureSpec:
    """``spec`` with ``id_counts[item]``: the logQ correction's training counts."""
    return dataclasses.replace(spec, id_counts={data.item: data.train_counts})


@torch.no_grad()
def next_item_metrics(model: nn.Module, data: NextItemData, split, job, device) -> dict[str, float]:
    """HR@K, NDCG@K, MRR of ``split``'s rows (module docstring), ``{}`` for another split.
    Collective: every rank embeds the whole catalogue; batches of ``eval.batch_size`` rows go
    round-robin over the ranks (batch i on rank ``i % world``), as
    ``recsys_dist.models.hstu_retrieval.evaluate_next_item``, so any world size gives the same
    numbers."""
    if not isinstance(split, str) or split not in data.targets:
        return {}
    m = next(x for x in model.modules() if isinstance(x, HSTUNextItem))
    histories, targets, cat = data.histories[split], data.targets[split], data.catalogue
    was_training = m.training
    m.eval()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    items = torch.cat([m.item_vectors(cat[i : i + 4096]).cpu() for i in range(0, len(cat), 4096)])
    dense = [np.searchsorted(cat, h) + 1 for h in histories]  # catalogue ids 1 .. C
    bs = job.eval.batch_size or job.train.batch_size
    batches = [range(lo, min(lo + bs, len(targets))) for lo in range(0, len(targets), bs)]
    mine: dict[int, list[int]] = {}
    for step in range(max(1, math.ceil(len(batches) / world))):
        i = step * world + rank
        rows = batches[i] if i < len(batches) else []
        # A rank without a batch still makes the same call into the sharded table.
        users = m.user_vectors([histories[r] for r in rows] or [cat[:1]]).cpu()
        if rows:
            t = np.searchsorted(cat, targets[list(rows)]) + 1
            mine[i] = target_ranks(users, items, t, [dense[r] for r in rows]).tolist()
    m.train(was_training)
    if world > 1:
        parts: list = [None] * world
        dist.all_gather_object(parts, mine)
        mine = {k: v for p in parts for k, v in p.items()}
    ks = job.eval.retrieval_k or DEFAULT_K
    out = ranking_metrics([r for i in range(len(batches)) for r in mine[i]], ks)
    out.pop("users")
    # The most-popular baseline (items by training rows, ties to the lower id), same targets and exclusions.
    counts = torch.as_tensor(data.train_counts[cat][:, None], dtype=torch.float64)
    ones = torch.ones(len(targets), 1, dtype=torch.float64)
    popular = ranking_metrics(target_ranks(ones, counts, np.searchsorted(cat, targets) + 1, dense).tolist(), ks)
    popular.pop("users")
    out.update({f"popular_{k}": v for k, v in popular.items()})
    return {**out, "next_item_rows": len(targets), "next_item_skipped": data.skipped[split], "catalogue": len(cat)}


def next_item_problems(job) -> list[str]:
    """What ``hstu_retrieval`` (and ``sasrec_retrieval``, which shares its data path) needs of the
    resolved run (``recsys_dist.train.preflight``); messages name ``job.model.name``."""
    m, d, f = job.model, job.data, job.features
    name = m.name
    h = d.schema.history if d.schema is not None else None
    if h is None or f.sequence_names != [h.name]:
        return [f"data.schema.history: {name} reads one user history (and no data.schema.sequence); add it"]
    problems = []
    if f.sparse_names != [m.item_id] or f.dense_names:
        problems.append(
            f"data.schema: {name} reads the item {m.item_id!r} and the history only; the data has "
            f"categorical {f.sparse_names} and dense {f.dense_names}: keep data.schema.categorical: [{m.item_id}]"
        )
    if h.item != m.item_id:
        problems.append(f"model.item_id: {m.item_id!r} is not the history's item column {h.item!r}; name the same")
    if d.categorical_mapping != "hash":
        problems.append(
            f"data.categorical_mapping: {name} reads the item and its history from one table, so a value "
            f"needs one id in both; {d.categorical_mapping} gives them different ids: use hash"
        )
    sizes = {t.num_embeddings for t in [*f.tables, *f.sequence_tables]}
    if len(sizes) > 1:
        problems.append(f"data.num_embeddings: the item and history tables must have one size, got {sorted(sizes)}")
    return problems + candidate_loss_problems(name, job.train.loss)


def next_item_parts(spec: FeatureSpec, cfg: NextItemConfig) -> tuple:
    """The next-item models' first constructor arguments (``HSTUNextItem.__init__``'s ``ec, keys,
    item, history, temperature, log_q``): one EmbeddingCollection over the history's table, read
    by the history and the item; ``log_q`` the items' logQ (``model.logq_correction``) or None."""
    (table,) = spec.sequence_tables
    history = spec.sequence_names[0]
    counts = spec.id_counts.get(cfg.item_id) if cfg.logq_correction else None
    ec = EmbeddingCollection(
        tables=[dataclasses.replace(table, feature_names=[cfg.item_id, history])], device=spec.embedding_device
    )
    log_q = log_q_of(counts).to(spec.device) if counts is not None else None
    return ec, spec.keys, cfg.item_id, history, cfg.temperature, log_q


# The next-item models' shared data path (read, item counts for logQ, leave-last-out metrics),
# as register_model's hooks; each model adds its own checks and encoder.
NEXT_ITEM_HOOKS = {"read_data": read_next_item_data, "on_data": with_item_counts, "evaluator": next_item_metrics}


@register_model(
    "hstu_retrieval", HSTURetrievalConfig, checks=(next_item_problems, no_history_extras), **NEXT_ITEM_HOOKS
)
def build_hstu_next_item(spec: FeatureSpec, cfg: HSTURetrievalConfig) -> HSTUNextItem:
    """:class:`HSTUNextItem` over one table: the history's, read by the history and the item."""
    return HSTUNextItem(
        *next_item_parts(spec, cfg),
        embedding_dim=cfg.embedding_dim,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        attention_dim=cfg.attention_dim,
        linear_dim=cfg.linear_dim,
        dropout=cfg.layer_dropout,
        max_positions=cfg.max_positions,
        device=spec.device,
        attention=cfg.attention,
    )
