"""HSTU for retrieval (Zhai et al., 2024, "Actions Speak Louder than Words", Section 4.1:
next-item prediction with sampled softmax), over one sharded item table.

The model (:class:`HSTURetrieval`):

- one TorchRec ``EmbeddingCollection`` with one item table ``t_item`` ([num_items + 1, D],
  row 0 = padding) read by two features: ``history`` (each user's item sequence, oldest first,
  jagged) and ``negatives`` (the step's sampled negatives, all in the batch's first row);
  input and output share it, as in the reference;
- the user's items ``e_1..e_n`` times ``sqrt(D)`` (the reference's input scaling; the
  reference also adds a learned absolute position embedding, left out here: the layers'
  relative position bias carries the order; nor is there its time bias), input dropout,
  then ``num_layers`` :class:`recsys_dist.models.zoo.hstu.HSTULayer` s under a causal mask
  (position i reads 1..i; padding is never read), run on the real positions only
  (``recsys_dist.models.hstu_jagged``), outputs L2-normalised: ``y_1..y_n``;
- score of item j after position i: ``s(i, j) = <y_i, normalize(e_j)> / temperature`` (the
  reference's cosine: L2-normalised user and item embeddings, dot product).

Training (:func:`sampled_softmax_loss`): every position i < n predicts the next item
``e_{i+1}`` (autoregressive, as the reference), against ``R`` negatives drawn uniformly from the
catalogue ``1 .. num_items`` once per step and shared by the batch's positions
(:func:`next_item_batch`; the reference draws per position). Uniform sampling has a constant
``q``, so the logQ correction cancels and none is applied; no in-batch negatives. A negative
equal to a position's positive is masked out of that position's softmax (as the reference).

Retrieval: :meth:`HSTURetrieval.user_vectors` is ``y_n`` (the last real position) and
:meth:`HSTURetrieval.item_vectors` the normalised table rows; :func:`evaluate_next_item` ranks
every target among all items less the history's (``recsys_dist.models.next_item``). Under DistributedModelParallel
the table is sharded like any other (``recsys_dist.distributed.sharding.shard``), the HSTU
layers are data-parallel.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.models import hstu_jagged
from recsys_dist.models.next_item import DEFAULT_K, ranking_metrics, target_ranks
from recsys_dist.models.sequence import padded_sequence
from recsys_dist.models.zoo.hstu import HSTULayer

HISTORY, NEGATIVES = "history", "negatives"
FEATURES = [HISTORY, NEGATIVES]
TABLE = "t_item"


def item_table(num_items: int, embedding_dim: int, init_scale: float | None = None) -> EmbeddingConfig:
    """The item table ``t_item``: ``num_items + 1`` rows (row 0: padding), read by ``history``
    and ``negatives``; uniform init in ``[-init_scale, init_scale]`` (None: TorchRec's
    ``sqrt(1 / rows)``)."""
    s = init_scale if init_scale is not None else math.sqrt(1.0 / (num_items + 1))
    return EmbeddingConfig(
        name=TABLE,
        embedding_dim=embedding_dim,
        num_embeddings=num_items + 1,
        feature_names=list(FEATURES),
        weight_init_min=-s,
        weight_init_max=s,
    )


class HSTURetrieval(nn.Module):
    """The model of the module docstring over ``ec`` (an EmbeddingCollection holding
    :func:`item_table`, or its sharded version).

    ``forward(kjt)`` (a KJT keyed ``[history, negatives]``, :func:`next_item_batch`) returns
    ``{"query": y_i [P, D], "positive": normalize(e_{i+1}) [P, D], "positive_ids": int64 [P],
    "negatives": [R, D] normalised, "negative_ids": int64 [R]}``, float32, one row per position
    with a next item (P = sum over rows of ``n - 1``), in row-major order.
    """

    def __init__(
        self,
        ec: EmbeddingCollection,
        embedding_dim: int,
        num_layers: int = 2,
        num_heads: int = 1,
        attention_dim: int = 50,
        linear_dim: int = 50,
        dropout: float = 0.2,
        max_positions: int = 64,
        device: torch.device | None = None,
        attention: str = "auto",
    ) -> None:
        super().__init__()
        self.seq_arch = ec
        self.dim, self.max_positions = embedding_dim, max_positions
        self.input_dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            HSTULayer(
                embedding_dim,
                num_heads,
                attention_dim,
                linear_dim,
                max_positions,
                dropout,
                device=device,
                attention=attention,
            )
            for _ in range(num_layers)
        )

    def encode(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, N, D] unit rows: ``y_1..y_N`` of the padded items ``values`` [B, N, D] (mask [B, N]),
        0 past each row's items. The layers run on the real positions only, packed
        (``HSTULayer.forward_jagged``); an empty row keeps one token at position 0 that reads
        nothing (its output: the empty history's vector, as the padded layers gave it)."""
        real = (mask > 0) | (torch.arange(mask.shape[1], device=mask.device) == 0)[None, :]
        lay = hstu_jagged.layout(real.sum(dim=1), mask.sum(dim=1))
        x = self.input_dropout(hstu_jagged.pack(values * mask.unsqueeze(-1), real) * math.sqrt(self.dim))
        for layer in self.layers:
            x = layer(x, layout=lay)
        return F.normalize(hstu_jagged.unpack(x, real), dim=-1)

    def forward(self, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        out = self.seq_arch(kjt)
        values, mask = padded_sequence(out, HISTORY)
        y = self.encode(values, mask)
        ids = kjt[HISTORY].to_padded_dense(desired_length=values.shape[1], padding_value=0)
        has_next = mask[:, 1:] > 0  # position i has a next item i + 1
        negatives = out[NEGATIVES]
        return {
            "query": y[:, :-1][has_next],
            "positive": F.normalize(values[:, 1:][has_next], dim=-1),
            "positive_ids": ids[:, 1:][has_next].long(),
            "negatives": F.normalize(negatives.values(), dim=-1),
            "negative_ids": kjt[NEGATIVES].values().long(),
        }

    def user_vectors(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """float32 [B, D], unit rows: ``y_n`` of each row's ``history`` (n >= 1 items; a row
        without items gets ``y_1`` of the padding, meaningless)."""
        values, mask = padded_sequence(self.seq_arch(kjt), HISTORY)
        y = self.encode(values, mask)
        last = (mask.sum(dim=1).long() - 1).clamp(min=0)
        return y[torch.arange(y.shape[0], device=y.device), last]

    def item_vectors(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), D], unit rows: the normalised table rows of ``ids`` (int64 [N], N >= 1)."""
        n = len(ids)
        lengths = torch.cat([torch.ones(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)])
        kjt = KeyedJaggedTensor.from_lengths_sync(list(FEATURES), ids.long(), lengths.to(ids.device))
        return F.normalize(self.seq_arch(kjt)[HISTORY].values(), dim=-1)


def history_kjt(histories: list[np.ndarray], negatives: np.ndarray | None = None) -> KeyedJaggedTensor:
    """The KJT ``[history, negatives]`` of one batch: row b's ``history`` = ``histories[b]``
    (int ids), every negative (int64 [R]) in row 0 (none: empty)."""
    b = len(histories)
    neg = np.zeros(0, np.int64) if negatives is None else np.asarray(negatives, dtype=np.int64)
    lengths = [len(h) for h in histories] + [len(neg)] + [0] * (b - 1)
    values = np.concatenate([*(np.asarray(h, dtype=np.int64) for h in histories), neg])
    return KeyedJaggedTensor.from_lengths_sync(
        list(FEATURES), torch.as_tensor(values, dtype=torch.int64), torch.as_tensor(lengths, dtype=torch.int32)
    )


def check_ids(sequences: list[np.ndarray], num_items: int, what: str) -> None:
    """Raise ValueError naming the first of ``sequences`` holding an id outside ``1 .. num_items``
    (0 is the padding row, not an item; a larger id is past the table)."""
    for i, s in enumerate(sequences):
        s = np.asarray(s)
        bad = s[(s < 1) | (s > num_items)]
        if len(bad):
            raise ValueError(
                f"{what} {i}: item id {int(bad[0])} is outside 1 .. {num_items} (ids are dense, "
                "recsys_dist.models.next_item.leave_last_out; 0 is padding)"
            )


def next_item_batch(
    sequences: list[np.ndarray], num_items: int, num_negatives: int, generator: np.random.Generator
) -> KeyedJaggedTensor:
    """A training batch: the ``sequences`` (dense ids, oldest first, each cut by the caller)
    and ``num_negatives`` ids drawn uniformly with replacement from ``1 .. num_items``.

    Raises:
        ValueError: a sequence holding an id outside ``1 .. num_items``, naming it.
    """
    check_ids(sequences, num_items, "sequence")
    return history_kjt(sequences, generator.integers(1, num_items + 1, size=num_negatives))


def sampled_softmax_loss(out: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Scalar float32: the mean over positions of ``-log softmax([s(pos), s(neg_1..R)])[0]``
    with ``s = <query, item> / temperature`` (module docstring); a negative equal to the
    position's positive is left out. 0 (still a graph over every input) for no position."""
    q = out["query"]
    pos = (q * out["positive"]).sum(dim=1, keepdim=True) / temperature  # [P, 1]
    neg = q @ out["negatives"].T / temperature  # [P, R]
    hit = out["negative_ids"][None, :] == out["positive_ids"][:, None]
    neg = neg.masked_fill(hit, float("-inf"))
    logits = torch.cat([pos, neg], dim=1)
    return -F.log_softmax(logits, dim=1)[:, 0].sum() / max(q.shape[0], 1)


def find_retrieval_model(model: nn.Module) -> HSTURetrieval:
    """The :class:`HSTURetrieval` inside ``model`` (itself, or inside a DMP / DDP wrapper)."""
    found = next((m for m in model.modules() if isinstance(m, HSTURetrieval)), None)
    if found is None:
        raise ValueError(f"{type(model).__name__} holds no HSTURetrieval")
    return found


@torch.no_grad()
def evaluate_next_item(
    model: nn.Module,
    histories: list[np.ndarray],
    targets: np.ndarray,
    num_items: int,
    batch_size: int = 256,
    ks=DEFAULT_K,
    device: torch.device | None = None,
    exclude_history: bool = True,
) -> dict[str, float]:
    """HR@K, NDCG@K and MRR (``recsys_dist.models.next_item.ranking_metrics``) of ``targets``
    (int64 [U], ids ``1 .. num_items``) after ``histories`` (U arrays of ids, oldest first, not
    empty), every target ranked among all ``num_items`` items; with ``exclude_history`` (the
    HSTU reference's protocol) less the other items of its own history.

    Collective when a process group exists (every rank passes the same arguments): every rank
    embeds the whole catalogue (the same calls into the sharded table on each rank), the users
    go in batches of ``batch_size`` in order, batch i on rank ``i % world``, and the ranks are
    gathered. A batch holds the same users at every world size, so the metrics are the same
    at every world size (to the bit on CPU with the same thread count).

    Raises:
        ValueError: lengths that differ, an empty history, a history id or a target outside
            ``1 .. num_items``.
    """
    if len(histories) != len(targets) or any(len(h) == 0 for h in histories):
        raise ValueError(f"evaluate_next_item: {len(histories)} histories (none empty) for {len(targets)} targets")
    check_ids(histories, num_items, "history")
    m = find_retrieval_model(model)
    device = device or torch.device("cpu")
    was_training = m.training
    m.eval()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    all_ids = torch.arange(1, num_items + 1)
    items = torch.cat([m.item_vectors(all_ids[i : i + 4096].to(device)).cpu() for i in range(0, num_items, 4096)])
    batches = [range(lo, min(lo + batch_size, len(targets))) for lo in range(0, len(targets), batch_size)]
    steps = max(1, math.ceil(len(batches) / world))
    mine: dict[int, list[int]] = {}
    for step in range(steps):
        i = step * world + rank
        rows = batches[i] if i < len(batches) else range(min(1, len(targets)))  # a spare rank repeats a row
        if len(rows) == 0:  # no target at all: still the same calls on every rank
            m.user_vectors(history_kjt([np.ones(1, np.int64)]).to(device))
            continue
        users = m.user_vectors(history_kjt([histories[r] for r in rows]).to(device)).cpu()
        if i < len(batches):
            seen = [histories[r] for r in rows] if exclude_history else None
            mine[i] = target_ranks(users, items, np.asarray(targets)[list(rows)], seen).tolist()
    m.train(was_training)
    if world > 1:
        parts: list = [None] * world
        dist.all_gather_object(parts, mine)
        mine = {k: v for p in parts for k, v in p.items()}
    ranks = [r for i in range(len(batches)) for r in mine[i]]
    return ranking_metrics(ranks, ks)
