"""HSTU against its baselines from the JSON lines of ``benchmarks/hstu_retrieval.py``: each
run's test metrics at its best validation epoch within one common epoch budget, and paired
bootstraps over users of HSTU minus each baseline.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/hstu_retrieval_compare.py LOG [LOG ...] [--budget EPOCHS] \
        [--record hstu_retrieval_baselines]

``LOG``: files holding ``hstu_retrieval.py``'s output (any mix of encoders and seeds). A
sequence model's run (``hstu``, ``sasrec``) prints its test ranks at every evaluation, so it is
read at the evaluation of best validation NDCG@10 among epochs <= ``--budget`` (default: the
last epoch every sequence run reached: the same budget for every run, also for runs stopped
early); the two-tower run by its final line (its own epochs). The paired bootstrap
(``harness.paired_bootstrap``) resamples the 671 users: the difference is the mean over seeds
of HSTU seed s minus the baseline's seed s on the same resampled users, seeds paired by number.
"""

from __future__ import annotations

import json
from collections import defaultdict

import harness
import numpy as np

from recsys_dist.models.next_item import ranking_metrics

SEQUENCE = ("hstu", "sasrec")
NAMES = {"hstu": "HSTU", "sasrec": "SASRec", "two_tower": "two-tower"}
COLUMNS = ("hr@10", "hr@50", "ndcg@10", "ndcg@50", "mrr")


def read(paths: list[str]) -> tuple[dict, dict, dict]:
    """(evaluations[(encoder, seed)] = [line, ...], finals[(encoder, seed)] = line, popular[split])."""
    evals, finals, popular = defaultdict(list), {}, {}
    for path in paths:
        with open(path) as f:
            for text in f:
                if not text.startswith("{"):
                    continue
                line = json.loads(text)
                key = (line.get("encoder"), line.get("seed"))
                if key[0] == "most_popular":
                    popular.update({k: v for k, v in line.items() if k != "encoder"})
                elif "test" in line and "test_ranks" in line:
                    finals[key] = line
                elif "test_ranks" in line:
                    evals[key].append(line)
    return evals, finals, popular


def pick(evals: dict, finals: dict, budget: int | None) -> tuple[dict, int]:
    """runs[(encoder, seed)] = {epoch, val, ranks} and the budget used."""
    if budget is None:
        budget = min(max(e["epoch"] for e in lines) for lines in evals.values())
    runs = {}
    for key, lines in evals.items():
        best = None
        for e in sorted(lines, key=lambda e: e["epoch"]):
            if e["epoch"] <= budget and (best is None or e["val_ndcg@10"] > best["val_ndcg@10"]):
                best = e
        runs[key] = {"epoch": best["epoch"], "val": best["val_ndcg@10"], "ranks": np.array(best["test_ranks"])}
    for key, line in finals.items():
        if key[0] not in SEQUENCE:
            runs[key] = {
                "epoch": line["epoch"],
                "val": line["validation"]["ndcg@10"],
                "ranks": np.array(line["test_ranks"]),
            }
    return runs, budget


def summary_table(runs: dict, popular: dict) -> list[str]:
    head = "| model | seeds | epoch (by val NDCG@10) | " + " | ".join(f"test {c.upper()}" for c in COLUMNS)
    out = [head + " | val NDCG@10 |", "| --- " * (len(COLUMNS) + 4) + "|"]
    if popular:
        cells = " | ".join(f"{popular['test'][c]:.4f}" for c in COLUMNS)
        out.append(f"| most popular | - | - | {cells} | {popular['validation']['ndcg@10']:.4f} |")
    for enc in ("hstu", "sasrec", "two_tower"):
        keys = sorted(k for k in runs if k[0] == enc)
        if not keys:
            continue
        metrics = [ranking_metrics(runs[k]["ranks"]) for k in keys]

        def cell(values):
            return f"{np.mean(values):.4f} ({min(values):.4f}-{max(values):.4f})"

        cells = " | ".join(cell([m[c] for m in metrics]) for c in COLUMNS)
        epochs = ",".join(str(runs[k]["epoch"]) for k in keys)
        seeds = ",".join(str(k[1]) for k in keys)
        out.append(f"| {NAMES[enc]} | {seeds} | {epochs} | {cells} | {cell([runs[k]['val'] for k in keys])} |")
    return out


def bootstrap_table(runs: dict, resamples: int) -> list[str]:
    out = [
        "| difference | seeds | "
        + " | ".join(f"{c.upper()} [95% interval]" for c in ("hr@10", "ndcg@10", "mrr"))
        + " |"
    ]
    out.append("| --- " * 5 + "|")
    for other in ("sasrec", "two_tower"):
        seeds = sorted(k[1] for k in runs if k[0] == other and ("hstu", k[1]) in runs)
        if not seeds:
            continue
        a = [runs["hstu", s]["ranks"] for s in seeds]
        b = [runs[other, s]["ranks"] for s in seeds]
        users = np.arange(len(a[0]))
        cells = []
        for c in ("hr@10", "ndcg@10", "mrr"):
            point, (lo, hi) = harness.paired_bootstrap(
                users, a, b, lambda _, r, c=c: ranking_metrics(r)[c], n=resamples
            )
            cells.append(f"{point:+.4f} [{lo:+.4f}, {hi:+.4f}]")
        out.append(f"| HSTU - {NAMES[other]} | {','.join(map(str, seeds))} | " + " | ".join(cells) + " |")
    return out


def curves(evals: dict, budget: int) -> list[str]:
    out = []
    for (enc, seed), lines in sorted(evals.items()):
        points = [f"{e['epoch']}:{e['val_ndcg@10']:.4f}" for e in sorted(lines, key=lambda e: e["epoch"])]
        out.append(f"{enc} {seed} " + " ".join(p for p in points if int(p.split(":")[0]) <= budget))
    return out


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "hstu_retrieval_baselines", "100 bootstrap resamples instead of 1,000")
    p.add_argument("logs", nargs="+", help="files of hstu_retrieval.py's JSON lines")
    p.add_argument("--budget", type=int, default=None, help="last epoch considered (default: the common last epoch)")
    a = p.parse_args(argv)
    with harness.Results(a, argv):
        evals, finals, popular = read(a.logs)
        runs, budget = pick(evals, finals, a.budget)
        print(f"sequence models read at epochs <= {budget}\n")
        print("\n".join(summary_table(runs, popular)) + "\n")
        print("\n".join(bootstrap_table(runs, 100 if a.smoke else 1000)) + "\n")
        print("Validation NDCG@10 along training (every 10 epochs):\n\n" + "\n".join(curves(evals, budget)))


if __name__ == "__main__":
    main()
