"""Global binary-classification metrics over all ranks' predictions.

Every metric is computed once over the union of all ranks' rows (padding rows, weight 0,
removed), never averaged per rank: a mean of per-rank AUCs is not the AUC of the union,
and ranks hold unequal numbers of rows. Two paths (definitions in ``docs/metrics.md``):

- exact: :func:`gather_predictions` copies every rank's (logit, label) to every rank and
  :func:`binary_metrics` sorts them. O(N) memory per rank; for validation/test sets that fit.
- streaming: :class:`StreamingBinaryMetrics` keeps a fixed histogram of predicted
  probabilities per class plus running sums, merged across ranks with one all_reduce.
  Memory is independent of N; AUC carries a bound it computes and returns.

Metrics (``c`` = mean label, ``p`` = sigmoid(logit)):

- ``auc``: P(score of a random positive > score of a random negative), ties count 1/2
  (Mann-Whitney U). Equals ``sklearn.metrics.roc_auc_score``. NaN with one class.
- ``logloss``: mean of ``-(y log p + (1-y) log(1-p))``, from logits for stability.
- ``ne``: normalized entropy (He et al., 2014): logloss / ``-(c log c + (1-c) log(1-c))``.
  NaN when ``c`` is 0 or 1.
- ``calibration``: mean(p) / mean(y). NaN without positives.
- ``accuracy``: fraction of rows with ``(p > 0.5) == y``.
- ``gauc`` (optional, needs group ids): per-group AUC averaged with weights = the group's
  number of rows, over groups holding both classes (Zhou et al., 2018, DIN).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

DEFAULT_NUM_BUCKETS = 1 << 16


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC, ties counted one half.

    Args:
        scores: float [N], any monotone score (logits or probabilities).
        labels: [N] of 0/1 (any numeric dtype).

    Returns:
        AUC in [0, 1]; NaN if one class is absent.
    """
    scores = scores.double().flatten()
    labels = labels.double().flatten()
    n_pos = float(labels.sum())
    n_neg = float(labels.numel() - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    # Average rank for tied scores: rank of a tie group = mean of its 1-based positions.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = (ends - (counts.double() - 1) / 2)[inverse]
    pos_rank_sum = float((avg_rank * labels[order]).sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def group_auc(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> tuple[float, int]:
    """GAUC: per-group exact AUC, averaged weighted by each group's number of rows.

    ``GAUC = sum_g n_g AUC_g / sum_g n_g`` over the groups g holding both a positive and a
    negative (a one-class group has no AUC and is skipped, rows and all). Vectorised: one
    sort by (group, score), no Python loop over groups.

    Args:
        scores: float [N].
        labels: [N] of 0/1.
        groups: integer [N] group ids (e.g. user ids); any values, need not be contiguous.

    Returns:
        (gauc, number of groups counted); gauc is NaN when no group has both classes.
    """
    scores = scores.double().flatten()
    labels = labels.double().flatten()
    groups = groups.flatten()
    if scores.numel() == 0:
        return float("nan"), 0
    # Stable sort by score, then stable sort by group: rows ordered by (group, score).
    order = torch.argsort(scores, stable=True)
    order = order[torch.argsort(groups[order], stable=True)]
    g, s, y = groups[order], scores[order], labels[order]
    _, g_idx, g_count = torch.unique_consecutive(g, return_inverse=True, return_counts=True)
    g_start = torch.cumsum(g_count, 0) - g_count  # 0-based position of each group's first row
    # A tie run is a maximal stretch with equal group and score; its rows share the mean rank.
    new_run = torch.ones_like(s, dtype=torch.bool)
    new_run[1:] = (g[1:] != g[:-1]) | (s[1:] != s[:-1])
    run_idx = torch.cumsum(new_run.long(), 0) - 1
    run_count = torch.bincount(run_idx)
    run_end = torch.cumsum(run_count, 0)  # 1-based global position of each run's last row
    rank_in_group = (run_end[run_idx] - g_start[g_idx]).double() - (run_count[run_idx].double() - 1) / 2
    n_groups = g_count.numel()
    pos = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g_idx, y)
    rank_sum = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g_idx, rank_in_group * y)
    neg = g_count.double() - pos
    ok = (pos > 0) & (neg > 0)
    if not bool(ok.any()):
        return float("nan"), 0
    auc_g = (rank_sum[ok] - pos[ok] * (pos[ok] + 1) / 2) / (pos[ok] * neg[ok])
    n = g_count[ok].double()
    return float((n * auc_g).sum() / n.sum()), int(ok.sum())


def logloss_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy (nats) of float logits [N] against 0/1 labels [N]."""
    return float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))


def base_entropy(ctr: float) -> float:
    """Entropy (nats) of a Bernoulli(ctr) label; NaN when ctr is 0 or 1 (NE undefined)."""
    if not 0.0 < ctr < 1.0:
        return float("nan")
    return -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))


def normalized_entropy(logloss: float, labels: torch.Tensor) -> float:
    """NE = logloss / entropy of the mean label of ``labels`` [N]; NaN on one class."""
    return logloss / base_entropy(float(labels.double().mean()))


def binary_metrics(
    logits: torch.Tensor, labels: torch.Tensor, *, groups: torch.Tensor | None = None
) -> dict[str, float]:
    """Exact metrics of one full set of predictions (already gathered, no padding).

    Args:
        logits: float [N].
        labels: [N] of 0/1.
        groups: optional integer [N] group ids; adds ``gauc`` and ``gauc_num_groups``.

    Returns:
        ``auc``, ``logloss``, ``ne``, ``calibration``, ``accuracy`` (floats, NaN where
        undefined) and ``num_examples`` (int).
    """
    probs = torch.sigmoid(logits.double())
    ll = logloss_from_logits(logits, labels)
    out = {
        "auc": auc(logits, labels),
        "logloss": ll,
        "ne": normalized_entropy(ll, labels),
        "calibration": float(probs.mean() / labels.double().mean()) if labels.sum() > 0 else float("nan"),
        "accuracy": float(((probs > 0.5).double() == labels.double()).double().mean()),
        "num_examples": int(labels.numel()),
    }
    if groups is not None:
        out["gauc"], out["gauc_num_groups"] = group_auc(logits, labels, groups)
    return out


def weighted_auc(scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> float:
    """Weighted ROC AUC of scores [N] against 0/1 labels [N] with row weights [N] >= 0: the
    weighted Mann-Whitney U, ties counting 1/2 (``sklearn.metrics.roc_auc_score`` with
    ``sample_weight``). NaN when either class has zero weight."""
    s, y, w = scores.double().flatten(), labels.double().flatten(), weights.double().flatten()
    order = torch.argsort(s)
    s, y, w = s[order], y[order], w[order]
    _, group = torch.unique_consecutive(s, return_inverse=True)  # one group per distinct score
    n = int(group.max()) + 1 if group.numel() else 0
    pos = torch.zeros(n, dtype=torch.float64).scatter_add_(0, group, w * y)
    neg = torch.zeros(n, dtype=torch.float64).scatter_add_(0, group, w * (1 - y))
    P, N = float(pos.sum()), float(neg.sum())
    if P <= 0 or N <= 0:
        return float("nan")
    below = torch.cumsum(neg, 0) - neg  # negative weight strictly below each score
    return float((pos * (below + 0.5 * neg)).sum()) / (P * N)


def task_metrics(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, kind: str) -> dict[str, float]:
    """Exact metrics of one task over gathered rows, each row weighted by ``weights`` [N] (the
    sample weight; 1 without ``data.schema.weight``). ``logits``, ``labels``: float [N].

    binary: ``auc`` (:func:`weighted_auc`), ``logloss`` (weighted mean), ``ne`` (logloss over
    the entropy of the weighted mean label), ``calibration`` (sum w p / sum w y),
    ``accuracy`` (weighted); regression: ``rmse`` = sqrt(sum w (f - y)^2 / sum w) and ``mae``
    = sum w |f - y| / sum w, with f the raw output (the logit). Plus ``num_examples`` (rows)
    and ``weight_sum``. NaN where undefined (no weight).
    """
    x, y, w = logits.double().flatten(), labels.double().flatten(), weights.double().flatten()
    W = float(w.sum())
    nan = float("nan")
    out: dict[str, float] = {}
    if kind == "regression":
        out["rmse"] = math.sqrt(float((w * (x - y) ** 2).sum()) / W) if W > 0 else nan
        out["mae"] = float((w * (x - y).abs()).sum()) / W if W > 0 else nan
    else:
        p = torch.sigmoid(x)
        ll = float((w * F.binary_cross_entropy_with_logits(x, y, reduction="none")).sum()) / W if W > 0 else nan
        ctr = float((w * y).sum()) / W if W > 0 else nan
        out["auc"] = weighted_auc(x, y, w)
        out["logloss"] = ll
        out["ne"] = ll / base_entropy(ctr) if W > 0 else nan
        out["calibration"] = float((w * p).sum()) / float((w * y).sum()) if float((w * y).sum()) > 0 else nan
        out["accuracy"] = float((w * ((p > 0.5).double() == y).double()).sum()) / W if W > 0 else nan
    out["num_examples"] = int(y.numel())
    out["weight_sum"] = W
    return out


def gather_rows(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """All ranks' rows ``rows[keep]`` (float [N, C] -> float64 [M, C] on CPU), concatenated in rank
    order, identical on every rank (``all_gather_object``; O(M) memory on every rank)."""
    local = rows[keep].double().cpu()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        local = torch.cat(parts, dim=0)
    return local


def gather_predictions(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    groups: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """All ranks' rows with weight > 0, concatenated in rank order, identical on every rank.

    Works without a process group (then only drops padding). Ranks may hold different
    numbers of rows, zero included. Uses ``all_gather_object``: O(total rows) memory on
    every rank; use :class:`StreamingBinaryMetrics` when that is too much.

    Args:
        logits: float [N] on any device.
        labels: [N] of 0/1, same device.
        weights: [N]; rows with weight <= 0 are padding and dropped.
        groups: optional integer [N] group ids for GAUC (kept int64, so ids above 2^24
            survive, which float32 would not).

    Returns:
        ``(logits, labels)`` float32 [M] on CPU, or ``(logits, labels, groups)`` with
        groups int64 [M] when ``groups`` is given; M = all ranks' rows with weight > 0.
    """
    keep = weights > 0
    local = [torch.stack([logits[keep].float(), labels[keep].float()]).cpu()]
    if groups is not None:
        local.append(groups[keep].long().cpu())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        local = [torch.cat([p[i] for p in parts], dim=-1) for i in range(len(local))]
    return (local[0][0], local[0][1]) + tuple(local[1:])


class StreamingBinaryMetrics:
    """Bounded-memory global metrics: probability histogram per class plus running sums.

    ``update`` per batch on each rank, then ``merge()`` (one all_reduce) and ``compute()``.
    State is one float64 tensor of ``2 * num_buckets + 5`` values whatever the number of
    rows; counts are exact up to 2^53 rows.

    Bucket b holds rows with p = sigmoid(logit) in [b/B, (b+1)/B) (p = 1 in the last).
    logloss, NE, calibration and accuracy are exact (sums over rows, not binned); only AUC
    is approximate. Histogram AUC counts a (positive, negative) pair as 1 when the positive
    is in a higher bucket and 1/2 when both share a bucket; the exact AUC differs only on
    same-bucket pairs, by at most 1/2 each, so::

        |AUC_hist - AUC_exact| <= sum_b pos_b * neg_b / (2 * P * N)  =: auc_error_bound

    ``compute()`` returns that bound, computed from the counts. It is small when few
    opposite-class pairs share a bucket (2^16 buckets, 10^5 rows of spread-out
    predictions: ~1e-5); it grows when predictions pile up in a few buckets, e.g. when
    many rows have p < 1/B or p >= 1 - 1/B (|logit| > ~11 for B = 2^16) and so share
    an edge bucket.

    Args:
        num_buckets: histogram size B (>= 2).
        device: where the state lives; inputs are moved there.

    Raises:
        ValueError: num_buckets < 2.
    """

    _NSUMS = 5  # running sums stored after the two histograms

    def __init__(self, num_buckets: int = DEFAULT_NUM_BUCKETS, device: torch.device | str = "cpu") -> None:
        if num_buckets < 2:
            raise ValueError(f"num_buckets must be >= 2, got {num_buckets}")
        self.num_buckets = int(num_buckets)
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Zero the state (start a new evaluation)."""
        # [pos histogram | neg histogram | n, sum y, sum p, sum logloss, correct]:
        # one flat tensor so merging is exactly one all_reduce.
        self.state = torch.zeros(2 * self.num_buckets + self._NSUMS, dtype=torch.float64, device=self.device)

    @property
    def pos_counts(self) -> torch.Tensor:
        """float64 [B]: positives per bucket."""
        return self.state[: self.num_buckets]

    @property
    def neg_counts(self) -> torch.Tensor:
        """float64 [B]: negatives per bucket."""
        return self.state[self.num_buckets : 2 * self.num_buckets]

    @property
    def _sums(self) -> torch.Tensor:
        return self.state[2 * self.num_buckets :]

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add one batch.

        Args:
            logits: float [N].
            labels: [N] of 0/1.
            weights: optional [N]; rows with weight <= 0 are padding and ignored, every
                other row counts once (the trainer's weights are 0/1 masks), matching
                :func:`gather_predictions`.

        Raises:
            ValueError: shapes differ.
        """
        logits, labels = logits.flatten(), labels.flatten()
        if logits.shape != labels.shape or (weights is not None and weights.numel() != logits.numel()):
            raise ValueError(f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and weights must match")
        if weights is not None:
            keep = weights.flatten() > 0
            logits, labels = logits[keep], labels[keep]
        x = logits.to(self.device, torch.float64)
        y = labels.to(self.device, torch.float64)
        p = torch.sigmoid(x)
        bucket = (p * self.num_buckets).long().clamp_(0, self.num_buckets - 1)
        # index_add_ rather than bincount: bincount with weights refuses to run on CUDA
        # under torch.use_deterministic_algorithms (train.deterministic).
        self.state.index_add_(0, bucket + (1 - y.long()) * self.num_buckets, torch.ones_like(y))
        sums = torch.stack(
            [
                torch.tensor(float(y.numel()), dtype=torch.float64, device=self.device),
                y.sum(),
                p.sum(),
                F.binary_cross_entropy_with_logits(x, y, reduction="sum"),
                ((p > 0.5).double() == y).double().sum(),
            ]
        )
        self._sums.add_(sums)

    def merge(self, group: dist.ProcessGroup | None = None) -> StreamingBinaryMetrics:
        """A new accumulator holding every rank's rows; ``self`` keeps its local state.

        Collective: every rank of ``group`` must call it. One all_reduce (SUM) of the
        state; on an NCCL group a CPU state goes through the current CUDA device. Without
        a process group (or world size 1) returns a copy.
        """
        merged = StreamingBinaryMetrics(self.num_buckets, self.device)
        merged.state = self.state.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            buf = merged.state
            if buf.device.type == "cpu" and dist.get_backend(group) == "nccl":
                buf = buf.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            merged.state = buf.to(self.device)
        return merged

    def compute(self) -> dict[str, float]:
        """Metrics of the rows seen (call on a merged accumulator for global metrics).

        Returns:
            The keys of :func:`binary_metrics` (``auc`` from the histogram) plus
            ``auc_error_bound`` (NaN with one class) and ``num_buckets``.
        """
        pos, neg = self.pos_counts, self.neg_counts
        n, n_pos, sum_p, sum_loss, correct = (float(v) for v in self._sums)
        n_neg = n - n_pos
        if n_pos > 0 and n_neg > 0:
            neg_below = torch.cumsum(neg, 0) - neg
            auc_hist = float((pos * (neg_below + neg / 2)).sum()) / (n_pos * n_neg)
            bound = float((pos * neg).sum()) / (2 * n_pos * n_neg)
        else:
            auc_hist = bound = float("nan")
        ll = sum_loss / n if n > 0 else float("nan")
        return {
            "auc": auc_hist,
            "logloss": ll,
            "ne": ll / base_entropy(n_pos / n) if n > 0 else float("nan"),
            "calibration": sum_p / n_pos if n_pos > 0 else float("nan"),
            "accuracy": correct / n if n > 0 else float("nan"),
            "num_examples": int(n),
            "auc_error_bound": bound,
            "num_buckets": self.num_buckets,
        }
