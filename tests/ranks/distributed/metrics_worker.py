"""One rank's side of the distributed metrics test (run via recsys_dist.testing.run_ranks).

Every rank regenerates the same full data set from a seed, keeps its own slice (slices of
unequal size, possibly empty), and appends padding rows (weight 0, label 1, logit +50)
that would move every metric if they were counted.
"""

from __future__ import annotations

import numpy as np
import torch

from recsys_dist.train.metrics import StreamingBinaryMetrics, binary_metrics, gather_predictions

PAD_LOGIT = 50.0


def make_data(seed: int, n: int, ties: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits float32 [n], labels float64 [n], groups int64 [n]) of one case.

    With ``ties`` a tenth of the logits are rounded to integers: exact ties, some across ranks.
    """
    g = np.random.default_rng(seed)
    labels = (g.random(n) < 0.3).astype(np.float64)
    logits = (g.normal(size=n) + labels).astype(np.float32)
    if ties:
        logits[: n // 10] = np.round(logits[: n // 10])
    groups = g.integers(0, 40, size=n).astype(np.int64) + (1 << 33)
    return logits, labels, groups


def rank_slice(counts: list[int], rank: int) -> slice:
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def check_metrics(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """For each case: exact (gather + binary_metrics, with GAUC) and streaming metrics."""
    out = []
    for case in cases:
        logits, labels, groups = make_data(case["seed"], sum(case["counts"]), case["ties"])
        part = rank_slice(case["counts"], rank)
        n_pad = case["pad"][rank]
        lg = torch.cat([torch.from_numpy(logits[part]), torch.full((n_pad,), PAD_LOGIT)])
        lb = torch.cat([torch.from_numpy(labels[part]).float(), torch.ones(n_pad)])
        gr = torch.cat([torch.from_numpy(groups[part]), torch.zeros(n_pad, dtype=torch.long)])
        w = torch.cat([torch.ones(len(lg) - n_pad), torch.zeros(n_pad)])
        # Shuffle so padding is interleaved with real rows, as after a padded last batch.
        perm = torch.randperm(len(lg), generator=torch.Generator().manual_seed(rank))
        lg, lb, gr, w = lg[perm], lb[perm], gr[perm], w[perm]

        all_lg, all_lb, all_gr = gather_predictions(lg, lb, w, groups=gr)
        exact = binary_metrics(all_lg, all_lb, groups=all_gr)

        acc = StreamingBinaryMetrics(case.get("buckets", 1 << 16))
        for i in range(0, len(lg), 97):
            acc.update(lg[i : i + 97], lb[i : i + 97], w[i : i + 97])
        local_n = acc.compute()["num_examples"]
        merged = acc.merge()
        out.append(
            {
                "exact": exact,
                "streaming": merged.compute(),
                "local_n": local_n,
                "local_n_after_merge": acc.compute()["num_examples"],
                "gathered_n": int(all_lb.numel()),
            }
        )
    return out
