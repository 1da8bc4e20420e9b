"""The lines ``recsys-dist train`` prints at the end of a run, from its summary (``summary.json``)."""

from __future__ import annotations

from recsys_dist.checkpoint import run_dir as run_dirs


def print_summary(summary: dict) -> None:
    """Print the run's outcome: rows, steps, throughput, validation / test metrics, the best
    checkpoint; or, for a resume with nothing left to train, the line that says so.

    Args:
        summary: ``summary.json``'s dict (``Trainer.fit``'s return value).
    """

    def fmt(x):
        return "n/a" if x is None else f"{x:.4f}"

    if summary.get("already_complete"):
        print("\n" + run_dirs.nothing_to_train(summary["run_dir"], summary["resumed_from"], summary["steps"]))
        return
    v, t = summary["validation"] or {}, summary["test"] or {}
    resumed = summary.get("resumed_at_step")
    print(
        f"\nrecsys-dist: trained {summary['rows_trained']} samples in {summary['steps']} steps on "
        f"{summary['world_size']} rank{'s' if summary['world_size'] != 1 else ''}, {summary['samples_per_s']} samples/s"
        + (f" (resumed at step {resumed})" if resumed is not None else "")
        + "\n"
        + split_lines(v, t, fmt)
        + retrieval_lines(v, t, fmt)
        + f"  run directory: {summary['run_dir']}"
    )
    best = summary.get("best")
    if best:
        print(
            f"  best validation {best['metric']} {fmt(best['value'])} at step {best['step']}"
            + (" (stopped early)" if best["early_stopped"] else "")
            + (f": {best['checkpoint']} (`best`)" if best.get("checkpoint") else "")
        )


def retrieval_lines(v: dict, t: dict, fmt) -> str:
    """recall@K / NDCG@K of a retrieval model (and the most-popular baseline's), per split."""
    ks = sorted({int(k.split("@")[1]) for k in [*v, *t] if k.startswith("recall@")})
    lines = ""
    for split, m in (("validation", v), ("test", t)):
        for k in ks:
            lines += (
                f"  {split:<11} recall@{k} {fmt(m.get(f'recall@{k}'))}  NDCG@{k} {fmt(m.get(f'ndcg@{k}'))}  "
                f"(most popular: recall@{k} {fmt(m.get(f'popular_recall@{k}'))}  NDCG@{k} {fmt(m.get(f'popular_ndcg@{k}'))})\n"
            )
    return lines


def split_lines(v: dict, t: dict, fmt) -> str:
    """The validation and test lines: AUC / logloss, or per task (several tasks) its metrics."""
    task_keys = [k for k in v if "/" in k] or [k for k in t if "/" in k]
    if not task_keys:
        return (
            f"  validation  AUC {fmt(v['auc'])}  logloss {fmt(v['logloss'])}\n"
            f"  test        AUC {fmt(t['auc'])}  logloss {fmt(t['logloss'])}\n"
        )
    names = list(dict.fromkeys(k.split("/")[0] for k in task_keys))
    shown = {"auc": "AUC", "logloss": "logloss", "rmse": "RMSE", "mae": "MAE"}
    lines = ""
    for split, m in (("validation", v), ("test", t)):
        for name in names:
            parts = [f"{label} {fmt(m.get(f'{name}/{k}'))}" for k, label in shown.items() if f"{name}/{k}" in m]
            lines += f"  {split:<11} {name}: {'  '.join(parts)}\n"
    return lines
