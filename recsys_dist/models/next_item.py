"""Next-item retrieval by the leave-last-out protocol of Kang & McAuley (2018, SASRec) and Zhai
et al. (2024, HSTU, Section 4.1.1): the split, exact ranks over the whole catalogue, HR@K,
NDCG@K and MRR.

- :func:`leave_last_out`: each user's interactions sorted by time (ties in the input's order);
  the last is the test target, the one before it the validation target, the rest the training
  sequence. A test target's history is the training sequence plus the validation item; a
  validation target's history is the training sequence.
- :func:`target_ranks`: the rank (1 = best) of each target among ALL items of the catalogue by
  the score ``<u, v_j>``, descending; an item scoring the same as the target counts as above
  it when its id is lower (ties go to the lower id, as in a stable sort of ids ascending).
  ``seen`` (optional, per user) removes items from that user's candidates, the target never:
  the HSTU reference's evaluation (``eval_metrics_v2_from_tensors`` with its default
  ``filter_invalid_ids=True``, as its trainer calls it) removes the items of the history the
  model read, so :func:`recsys_dist.models.hstu_retrieval.evaluate_next_item` passes those.
- :func:`ranking_metrics`: ``HR@K`` = the share of targets of rank <= K; ``NDCG@K`` = the mean
  of ``1 / log2(rank + 1)`` over targets of rank <= K (0 above K; one relevant item, so the
  ideal DCG is 1); ``MRR`` = the mean of ``1 / rank`` over the full ranking (no cut-off).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_K = (10, 50)
USER_CHUNK = 1024  # users scored at once: [USER_CHUNK, catalogue] float32 scores


@dataclass
class LeaveLastOut:
    """The leave-last-out split of one interaction log. Item ids are dense: ``1 .. num_items``
    (0 is padding), id ``j`` is the raw item ``items[j - 1]`` (raw ids ascending).

    Attributes:
        items: int64 [num_items], the raw item id of each dense id ``1 .. num_items`` (every
            item of the log: the catalogue ranked at evaluation).
        users: int64 [U], the raw id of each kept user, ascending.
        train: U arrays of dense item ids (int64), oldest first: all but each user's last two.
        validation: int64 [U], the dense id of each user's second-to-last item.
        test: int64 [U], the dense id of each user's last item.
        dropped_users: users with fewer than 3 interactions (left out: no training item).
    """

    items: np.ndarray
    users: np.ndarray
    train: list[np.ndarray]
    validation: np.ndarray
    test: np.ndarray
    dropped_users: int

    @property
    def num_items(self) -> int:
        return len(self.items)

    def histories(self, split: str, max_length: int) -> list[np.ndarray]:
        """The inputs of ``split``'s targets (``"validation"``: the training sequence;
        ``"test"``: it plus the validation item), each cut to its last ``max_length`` items."""
        if split == "validation":
            seqs = self.train
        elif split == "test":
            seqs = [np.append(s, v) for s, v in zip(self.train, self.validation)]
        else:
            raise ValueError(f"split must be 'validation' or 'test', got {split!r}")
        return [s[-max_length:] for s in seqs]

    def targets(self, split: str) -> np.ndarray:
        """int64 [U]: the dense ids of ``split``'s targets."""
        return {"validation": self.validation, "test": self.test}[split]


def leave_last_out(users, items, times) -> LeaveLastOut:
    """The split of the module docstring from one row per interaction (equal-length 1-D arrays
    of raw user ids, raw item ids (int) and times (any sortable numbers)).

    Raises:
        ValueError: arrays of different lengths or not 1-D, or no user with 3 interactions.
    """
    users, items, times = (np.asarray(a) for a in (users, items, times))
    if users.ndim != 1 or not (users.shape == items.shape == times.shape):
        raise ValueError(
            f"leave_last_out: users, items and times must be 1-D and of one length, got shapes "
            f"{users.shape}, {items.shape}, {times.shape}"
        )
    catalogue, dense = np.unique(items, return_inverse=True)
    dense = dense.astype(np.int64) + 1
    order = np.lexsort((np.arange(len(users)), times, users))  # by user, then time, then input order
    u_sorted, d_sorted = users[order], dense[order]
    kept, starts = np.unique(u_sorted, return_index=True)
    seqs = np.split(d_sorted, starts[1:]) if len(kept) else []
    long_enough = [i for i, s in enumerate(seqs) if len(s) >= 3]
    if not long_enough:
        raise ValueError("leave_last_out: no user has 3 interactions (a training item, a validation and a test target)")
    return LeaveLastOut(
        items=catalogue.astype(np.int64),
        users=kept[long_enough].astype(np.int64),
        train=[seqs[i][:-2] for i in long_enough],
        validation=np.array([seqs[i][-2] for i in long_enough], dtype=np.int64),
        test=np.array([seqs[i][-1] for i in long_enough], dtype=np.int64),
        dropped_users=len(seqs) - len(long_enough),
    )


def _seen_mask(seen: list[np.ndarray] | None, lo: int, hi: int, num_items: int) -> torch.Tensor | None:
    """bool [hi - lo, C]: True at the ``seen`` items (ids 1 .. C; others ignored) of users lo..hi-1."""
    if seen is None:
        return None
    block = [np.asarray(x, dtype=np.int64) for x in seen[lo:hi]]
    rows = np.repeat(np.arange(len(block)), [len(x) for x in block])
    ids = np.concatenate(block) if block else np.zeros(0, np.int64)
    keep = (ids >= 1) & (ids <= num_items)
    mask = torch.zeros(hi - lo, num_items, dtype=torch.bool)
    mask[torch.as_tensor(rows[keep]), torch.as_tensor(ids[keep] - 1)] = True
    return mask


def target_ranks(
    user_vectors: torch.Tensor, item_vectors: torch.Tensor, targets, seen: list[np.ndarray] | None = None
) -> torch.Tensor:
    """int64 [U]: the rank (1 = best) of ``targets[u]`` (int, dense ids ``1 .. C``) among the
    ``C`` items for user ``u``, by the scores ``user_vectors [U, D] @ item_vectors [C, D]^T``
    (row ``j - 1`` of ``item_vectors`` is item ``j``); ties to the lower id (module docstring).
    ``seen``: per user, item ids left out of their candidates (the target stays; ids outside
    ``1 .. C`` are ignored). The target's score is read from the same score matrix, so it is
    ranked against exactly the numbers it is compared with. Chunks of ``USER_CHUNK`` users.

    Raises:
        ValueError: a target outside ``1 .. C`` or shapes that do not match.
    """
    targets = torch.as_tensor(np.asarray(targets), dtype=torch.int64)
    num_items = item_vectors.shape[0]
    if targets.shape != (user_vectors.shape[0],) or user_vectors.shape[1:] != item_vectors.shape[1:]:
        raise ValueError(
            f"target_ranks: users {tuple(user_vectors.shape)}, items {tuple(item_vectors.shape)} and targets "
            f"{tuple(targets.shape)} do not match ([U, D], [C, D], [U])"
        )
    if seen is not None and len(seen) != len(targets):
        raise ValueError(f"target_ranks: {len(seen)} seen lists for {len(targets)} targets")
    if len(targets) and (int(targets.min()) < 1 or int(targets.max()) > num_items):
        raise ValueError(
            f"target_ranks: targets must be item ids 1 .. {num_items}, got {targets.min()}..{targets.max()}"
        )
    ids = torch.arange(1, num_items + 1)
    out = []
    for lo in range(0, len(targets), USER_CHUNK):
        t = targets[lo : lo + USER_CHUNK]
        scores = user_vectors[lo : lo + USER_CHUNK] @ item_vectors.T  # [u, C]
        own = scores.gather(1, (t - 1)[:, None])  # [u, 1]
        above = (scores > own) | ((scores == own) & (ids[None, :] < t[:, None]))
        excluded = _seen_mask(seen, lo, lo + len(t), num_items)
        if excluded is not None:
            above &= ~excluded  # the target itself is never above itself, so it always stays
        out.append(above.sum(dim=1) + 1)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def top_k(
    user_vectors: torch.Tensor, item_vectors: torch.Tensor, k: int, seen: list[np.ndarray] | None = None
) -> torch.Tensor:
    """int64 [U, min(k, C)]: each user's ``k`` best items (dense ids ``1 .. C``), best first, by
    the scores of :func:`target_ranks` with its ties to the lower id: the exact nearest
    neighbours (inner product) over the whole catalogue, chunks of ``USER_CHUNK`` users.
    ``seen``: per user, items to leave out; they go last (after every other item, by id), so
    with ``k`` above the number of candidates they fill the tail."""
    out = []
    for lo in range(0, user_vectors.shape[0], USER_CHUNK):
        scores = (user_vectors[lo : lo + USER_CHUNK] @ item_vectors.T).double()
        excluded = _seen_mask(seen, lo, lo + scores.shape[0], item_vectors.shape[0])
        if excluded is not None:
            scores = scores.masked_fill(excluded, float("-inf"))
        out.append(torch.sort(-scores, dim=1, stable=True).indices[:, :k] + 1)
    return torch.cat(out) if out else torch.zeros(0, min(k, item_vectors.shape[0]), dtype=torch.int64)


def ranking_metrics(ranks, ks=DEFAULT_K) -> dict[str, float]:
    """``{"hr@K", "ndcg@K" for K in ks, "mrr", "users"}`` of the ranks (int >= 1, one per
    target; module docstring), means in float64 (NaN for no target)."""
    r = np.asarray(ranks, dtype=np.float64)
    out: dict[str, float] = {}
    for k in sorted(set(ks)):
        hit = r <= k
        out[f"hr@{k}"] = float(hit.mean()) if len(r) else float("nan")
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(r + 1.0), 0.0).mean()) if len(r) else float("nan")
    out["mrr"] = float((1.0 / r).mean()) if len(r) else float("nan")
    out["users"] = len(r)
    return out


def popular_vectors(train: list[np.ndarray], num_items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The most-popular baseline as vectors for :func:`target_ranks`: users ``[U, 1]`` of ones,
    items ``[C, 1]`` = each item's count in the training sequences (float64: exact counts)."""
    counts = np.bincount(np.concatenate(train) if train else np.zeros(0, np.int64), minlength=num_items + 1)
    return torch.ones(len(train), 1, dtype=torch.float64), torch.as_tensor(counts[1:, None], dtype=torch.float64)
