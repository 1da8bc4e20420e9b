"""Global metrics at world sizes 1, 2 and 3 equal scikit-learn on the union of all rows.

Ranks hold unequal numbers of rows (one case leaves the last rank with padding only;
two cases have many exact ties, some across ranks; one uses only 64 buckets) and
padding rows (weight 0, label 1, logit +50) that must not count. One spawn per world size
checks both paths (gather + binary_metrics with GAUC, and StreamingBinaryMetrics) on every
case and every rank.
"""

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, log_loss, roc_auc_score

from recsys_dist.testing import run_ranks
from tests.ranks.distributed import metrics_worker


def _cases(world_size: int) -> list[dict]:
    uneven = {1: [2500], 2: [1700, 800], 3: [1400, 1001, 99]}[world_size]
    last_empty = uneven[:-1] + [0] if world_size > 1 else [600]
    return [
        {"seed": 10 + world_size, "counts": uneven, "pad": [7 * (r + 1) for r in range(world_size)], "ties": False},
        {"seed": 20 + world_size, "counts": last_empty, "pad": [3] * (world_size - 1) + [64], "ties": True},
        {"seed": 30 + world_size, "counts": uneven, "pad": [1] * world_size, "ties": True, "buckets": 64},
    ]


def _reference(case: dict) -> dict:
    logits, labels, groups = metrics_worker.make_data(case["seed"], sum(case["counts"]), case["ties"])
    x = logits.astype(np.float64)  # the ranks compute from float32 logits too
    p = 1 / (1 + np.exp(-x))
    c = labels.mean()
    num = den = 0.0
    for g in np.unique(groups):
        m = groups == g
        if 0 < labels[m].sum() < m.sum():
            num, den = num + m.sum() * roc_auc_score(labels[m], x[m]), den + m.sum()
    return {
        "auc": roc_auc_score(labels, x),
        "logloss": log_loss(labels, p),
        "ne": log_loss(labels, p) / -(c * np.log(c) + (1 - c) * np.log(1 - c)),
        "calibration": p.mean() / c,
        "accuracy": accuracy_score(labels, p > 0.5),
        "num_examples": labels.size,
        "gauc": num / den,
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_global_metrics_match_sklearn(world_size):
    cases = _cases(world_size)
    results = run_ranks(metrics_worker.check_metrics, world_size, cases, timeout_s=120)
    failures = []

    def check(where, got, want, tol):
        if not abs(got - want) <= tol:
            failures.append(f"{where}: got {got!r}, sklearn {want!r} (tol {tol:g})")

    for ci, case in enumerate(cases):
        ref = _reference(case)
        for rank, per_case in enumerate(results):
            r = per_case[ci]
            where = f"ws={world_size} case={ci} rank={rank}"
            ex, st = r["exact"], r["streaming"]
            check(f"{where} gathered rows", r["gathered_n"], ref["num_examples"], 0)
            check(f"{where} local rows", r["local_n"], case["counts"][rank], 0)
            check(f"{where} merge left local state", r["local_n_after_merge"], case["counts"][rank], 0)
            for k, tol in [("auc", 1e-12), ("gauc", 1e-12), ("num_examples", 0)]:
                check(f"{where} exact {k}", ex[k], ref[k], tol)
            for k in ("logloss", "ne", "calibration", "accuracy"):
                check(f"{where} exact {k}", ex[k], ref[k], 1e-9 * max(1.0, abs(ref[k])))
                check(f"{where} streaming {k}", st[k], ref[k], 1e-9 * max(1.0, abs(ref[k])))
            check(f"{where} streaming num_examples", st["num_examples"], ref["num_examples"], 0)
            check(f"{where} streaming auc within its bound", st["auc"], ref["auc"], st["auc_error_bound"])
            # Exact ties share a bucket too and count in the bound (which then overstates
            # the error: both paths count a tie 1/2), so "small" is asserted without ties.
            if not case["ties"]:
                check(f"{where} streaming bound small", st["auc_error_bound"], 0.0, 1e-3)
            # Every rank must report the same global numbers.
            check(f"{where} same as rank 0", st["auc"], results[0][ci]["streaming"]["auc"], 0)
            check(f"{where} exact same as rank 0", ex["auc"], results[0][ci]["exact"]["auc"], 0)
    assert not failures, "\n".join(failures)
