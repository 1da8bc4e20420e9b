"""``recsys-dist report`` and ``recsys-dist compare``: a run directory as text (and PNG plots),
two side by side.

    recsys-dist report RUN_DIR [--no-plots] [--out DIR]
    recsys-dist compare RUN_A RUN_B

The run directory is read by ``recsys_dist.cli.run_metrics`` (what it holds: see there) and
plotted by ``recsys_dist.cli.run_plots``. A ``data.stream`` run (``recsys_dist.train.stream``)
gets its partitions instead of the validation / test table: trained, quarantined, why it
stopped, and a per-partition table of the progressive-validation metrics.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

from recsys_dist.cli.run_metrics import (
    EVAL_KEYS,
    MANAGED_COUNTERS,
    STOP_REASONS,
    Run,
    headline,
    load_run,
    mean,
    partitions,
    plan_bytes_per_rank,
    plan_per_rank,
    progressive,
    scored_validation,
    stream_state,
    time_keys,
    weights_step,
)
from recsys_dist.cli.run_plots import write_plots
from recsys_dist.errors import RunDirError

__all__ = ["RunDirError", "cmd_compare", "cmd_report", "compare", "load_run", "report", "write_plots"]

# A stream run's partition table shows every partition up to this many, else the first and
# last SHOWN_AT_ENDS with a "... N more" row between.
MAX_PARTITION_ROWS = 12
SHOWN_AT_ENDS = 5
MAX_QUARANTINE_LINES = 5


def _num(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, int) or (isinstance(x, float) and digits == 0):
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _delta(a, b, digits: int = 4, pct: bool = False) -> str:
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)):
        return ""
    d = f"{b - a:+.{digits}f}"
    if pct and a:
        d += f" ({(b - a) / abs(a):+.1%})"
    return d


def _table(rows: list[list[str]], indent: str = "  ") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---------------------------------------------------------------- report


def report(run_dir: str | Path, *, plots: bool = True, out_dir: str | Path | None = None) -> str:
    """Text summary of a run; with ``plots``, also writes PNGs (see :func:`write_plots`).

    Args:
        run_dir: the run directory.
        plots: write the PNG plots.
        out_dir: where the PNGs go (default: the run directory).

    Returns:
        The report text (no trailing newline).

    Raises:
        RunDirError: see :func:`load_run`.
        OSError: the plots cannot be written to ``out_dir``.
    """
    run = load_run(run_dir)
    h = headline(run)
    lines = [f"run {run.path}"]
    lines.append(
        f"  steps {_num(h['steps'])}  rows trained {_num(h['rows'])}  "
        f"samples/s {_num(h['samples_per_s'], 1)}  ranks {_num(h['world_size'])}"
    )
    finals = {split: run.final(split) for split in ("validation", "test")}
    if run.stream:  # validation lines score partitions (the partition table); a test split only if run
        lines += _stream_lines(run)
        finals = {split: f for split, f in finals.items() if f}
        if finals.get("test"):
            lines.append(_table(_metric_rows({"test": finals["test"]})))
    else:
        finals["validation"] = scored_validation(run)  # the test split's weights', not the last
        lines.append(_table(_metric_rows(finals)))
        lines += _weights_lines(run, finals["validation"])
    retrieval = _retrieval_rows(finals)
    if retrieval:
        lines.append("  retrieval over the item corpus (model vs most popular; recsys_dist.models.retrieval):")
        lines.append(_table(retrieval, indent="    "))
    lines += _train_lines(run)
    wall = _wall_split((run.summary or {}).get("wall_split"), (run.summary or {}).get("wall_seconds"))
    if wall:
        lines.append(wall)
    lines += _plan_lines(run.plan or [])
    ledger = run.final("ledger")
    if isinstance(ledger.get("per_rank"), list) and ledger["per_rank"]:
        lines.append(_ledger_line(ledger))
    if run.missing:
        lines.append(f"  missing: {', '.join(run.missing)} (run unfinished or interrupted?)")
    if run.bad_lines:
        lines.append(f"  skipped {run.bad_lines} unreadable line(s) of metrics.jsonl")
    if plots:
        written = write_plots(run, Path(out_dir) if out_dir else run.path)
        lines.append(f"  plots: {', '.join(str(p) for p in written) if written else 'none (no data to plot)'}")
    return "\n".join(lines)


def _weights_lines(run: Run, validation: dict) -> list[str]:
    """A line when the weights scored are not the last ones (early stopping put back the best
    validation's): whose they are, and the last validation, of the weights discarded."""
    step, test, last = weights_step(run), run.final("test"), run.final("validation")
    trained = test.get("step") if isinstance(test.get("step"), int) else headline(run)["steps"]
    if step is None or step == trained:
        return []
    line = (
        f"  validation and test: the weights of step {step}, the best validation's "
        f"(train.early_stopping.restore_best); trained to step {_num(trained)}"
    )
    if last and last is not validation and last.get("step") != step:
        line += (
            f"; the last validation (step {_num(last.get('step'))}, weights not kept): "
            f"AUC {_num(last.get('auc'))}, logloss {_num(last.get('logloss'))}"
        )
    return [line]


def _stream_lines(run: Run) -> list[str]:
    """A stream run: partitions trained / quarantined / why it stopped, the quarantine errors,
    the pooled progressive-validation metrics and the per-partition table."""
    trained, quarantined, stopped = stream_state(run)
    why = f"{stopped} ({STOP_REASONS[stopped]})" if stopped in STOP_REASONS else (stopped or "n/a (no summary.json)")
    lines = [f"  stream: {len(trained)} partition(s) trained, {len(quarantined)} quarantined; stopped: {why}"]
    for name, err in list(quarantined.items())[:MAX_QUARANTINE_LINES]:
        if name in err:  # the error starts with the partition's path; its name is already shown
            err = err[err.index(name) + len(name) :].lstrip(",: ")
        lines.append(f"    quarantined {name}: {err if len(err) <= 120 else err[:117] + '...'}")
    if len(quarantined) > MAX_QUARANTINE_LINES:
        lines.append(f"    ... and {len(quarantined) - MAX_QUARANTINE_LINES} more (summary.json's quarantined)")
    parts = partitions(run)
    pooled = progressive(parts)
    if pooled:
        lines.append(
            f"  progressive validation ({pooled['partitions']} partition(s) scored before training on them, "
            f"{_num(pooled['rows'])} rows; row-weighted means of the partitions' values): "
            f"AUC {_num(pooled['auc'])}, logloss {_num(pooled['logloss'])}, NE {_num(pooled['ne'])}"
        )
    if parts:
        lines.append(_table(_partition_rows(parts), indent="    "))
    return lines


def _partition_rows(parts: list[dict]) -> list[list[str]]:
    """The per-partition table: step after it, rows, progressive AUC / logloss / NE, seconds and,
    with managed-collision tables, the counters summed over features; long ones elided."""
    managed = any(p["managed"] for p in parts)
    rows = [["partition", "step", "rows", "AUC", "logloss", "NE", "seconds"]]
    if managed:
        rows[0] += list(MANAGED_COUNTERS)
    shown: list = parts
    if len(parts) > MAX_PARTITION_ROWS:
        shown = [*parts[:SHOWN_AT_ENDS], None, *parts[-SHOWN_AT_ENDS:]]
    for p in shown:
        if p is None:
            rows.append([f"... {len(parts) - 2 * SHOWN_AT_ENDS} more"] + [""] * (len(rows[0]) - 1))
            continue
        name = p["partition"] + ("" if p["trained"] else " (unfinished)")
        row = [name, _num(p.get("step")), _num(p.get("rows")), *(_num(p.get(k)) for k in ("auc", "logloss", "ne"))]
        row.append(_num(p.get("seconds"), 2))
        if managed:
            row += [_num((p["managed"] or {}).get(k)) for k in MANAGED_COUNTERS]
        rows.append(row)
    return rows


def _metric_rows(finals: dict) -> list[list[str]]:
    """The final validation / test metrics: a row per split, or per split and task (several tasks)."""
    tasks = list(dict.fromkeys(k.split("/")[0] for f in finals.values() for k in f if "/" in k))
    if not tasks:
        rows = [["split", "step", "AUC", "logloss", "NE", "calibration", "accuracy", "examples"]]
        for split, f in finals.items():
            rows.append([split, _num(f.get("step")), *(_num(f.get(k)) for k in EVAL_KEYS), _num(f.get("num_examples"))])
        return rows
    # several tasks: a row per split and task; RMSE / MAE for regression tasks
    rows = [["split", "task", "step", "AUC", "logloss", "NE", "calibration", "RMSE", "MAE", "examples"]]
    for split, f in finals.items():
        for task in tasks:
            keys = ("auc", "logloss", "ne", "calibration", "rmse", "mae")
            rows.append(
                [split, task, _num(f.get("step")), *(_num(f.get(f"{task}/{k}")) for k in keys)]
                + [_num(f.get("num_examples"))]
            )
    return rows


def _train_lines(run: Run) -> list[str]:
    """The last train loss, the managed-collision tables, and the mean step time by phase."""
    lines = []
    train = run.split("train")
    if train:
        last = train[-1]
        per_task = "".join(f", {k[5:]} {_num(v)}" for k, v in last.items() if k.startswith("loss/"))
        lines.append(
            f"  last train loss {_num(last.get('loss'))}"
            + (f" (per task before loss_weights: {per_task[2:]})" if per_task else "")
            + f" at step {_num(last.get('step'))}"
        )
    managed = _managed_rows(run)
    if managed:
        lines.append("  managed-collision tables (occupancy and evictions at the end; default-row share of lookups):")
        lines.append(_table(managed, indent="    "))
        remap_ms = mean([r.get("managed_remap_ms_per_step") for r in train])
        if remap_ms is not None:
            lines.append(f"    remapping {_num(remap_ms, 2)} ms per step (in the forward time; all_gather included)")
    tkeys = time_keys(train)
    if tkeys:
        means = {k: mean([r.get(k) for r in train]) for k in tkeys}
        total = sum(v for v in means.values() if v is not None)
        parts = [f"{k[5:-3]} {_num(v, 2)} ms ({v / total:.0%})" for k, v in means.items() if v is not None and total]
        lines.append("  mean step time: " + ", ".join(parts))
    return lines


def _plan_lines(plan: list) -> list[str]:
    """plan.json in two lines: embedding MiB per rank, tables by sharding type and per rank."""
    if not plan:
        return []
    lines = []
    types = Counter(e.get("sharding_type", "?") for e in plan)
    per_rank = plan_per_rank(plan)
    memory = plan_bytes_per_rank(plan)
    if memory:
        lines.append(
            "  embedding weights per rank (MiB): " + ", ".join(f"r{r} {b / 2**20:.1f}" for r, b in memory.items())
        )
    lines.append(
        f"  plan: {len(plan)} tables ({', '.join(f'{t} {n}' for t, n in sorted(types.items()))}); "
        f"tables per rank: {', '.join(f'r{r} {sum(c.values())}' for r, c in per_rank.items())}"
    )
    return lines


def _wall_split(split, wall) -> str | None:
    """summary.json's wall-time split as one line: ``wall 187.0 s: startup 12.1 s (6%), ...``."""
    if not isinstance(split, dict) or not isinstance(wall, (int, float)) or wall <= 0:
        return None
    parts = [f"{k} {v:.1f} s ({v / wall:.0%})" for k, v in split.items() if isinstance(v, (int, float))]
    return f"  wall time {wall:.1f} s: " + ", ".join(parts)


def _ledger_line(ledger: dict) -> str:
    """The busiest rank's bytes per step by phase, from the metrics.jsonl ledger line."""

    def sent(row: dict, phase: str) -> float:
        v = row.get(phase, {}).get("sent", 0) if isinstance(row.get(phase), dict) else 0
        return v if isinstance(v, (int, float)) else 0

    phases = ("input_dist", "output_dist_forward", "output_dist_backward", "allreduce")
    # managed-collision tables; the dense tower under distributed.dense.strategy: fsdp or pipeline
    for extra in ("managed_all_gather", "fsdp_all_gather", "fsdp_reduce_scatter", "pipeline_io", "pipeline_p2p"):
        if any(sent(row, extra) for row in ledger["per_rank"]):
            phases += (extra,)
    top = max(ledger["per_rank"], key=lambda row: sum(sent(row, p) for p in phases))
    parts = ", ".join(f"{p} {sent(top, p) / 1024:.1f}" for p in phases)
    precision = f"{ledger.get('forward_precision', '?')}/{ledger.get('backward_precision', '?')}"
    line = f"  wire KiB sent per step (ledger, busiest rank r{top.get('rank', '?')}, output_dist {precision}): {parts}"
    if ledger.get("unmodelled_tables"):
        line += f"; not counted: the EmbeddingCollection tables {', '.join(ledger['unmodelled_tables'])}"
    unsized = ledger.get("unsized_multi_hot")
    if isinstance(unsized, list) and unsized:  # recsys_dist.distributed.ledger: their bags counted as 1 id
        line += f" (multi-hot {', '.join(map(str, unsized))} counted as 1 id per example)"
    return line


def _retrieval_rows(finals: dict) -> list[list[str]]:
    """Rows of recall@K / NDCG@K per split and K (retrieval models), or [] when there are none."""
    ks = sorted({int(k.split("@")[1]) for f in finals.values() for k in f if k.startswith("recall@")})
    if not ks:
        return []
    rows = [["split", "K", "recall", "NDCG", "popular recall", "popular NDCG", "users", "items"]]
    for split, f in finals.items():
        for k in ks:
            keys = (f"recall@{k}", f"ndcg@{k}", f"popular_recall@{k}", f"popular_ndcg@{k}")
            rows.append(
                [
                    split,
                    str(k),
                    *(_num(f.get(key)) for key in keys),
                    _num(f.get("retrieval_users")),
                    _num(f.get("corpus_items")),
                ]
            )
    return rows


def _managed_rows(run: Run) -> list[list[str]]:
    """Per managed feature: occupancy, rows used, evictions, and the default-row share of the
    last train window, validation and test lookups (``managed`` in metrics.jsonl). For a stream
    run the validation share is the last partition's, scored before training on it."""
    last = {s: run.final(s).get("managed") or {} for s in ("train", "validation", "test")}
    end = last["test"] or last["validation"] or last["train"]
    if run.stream:  # its last validation scored the last partition before training on it
        end = last["test"] or last["train"] or last["validation"]
    if not end:
        return []
    rows = [["feature", "occupancy", "rows used", "evictions", "default: train", "validation", "test"]]
    for f, st in end.items():
        share = [_num((last[s].get(f) or {}).get("default_share")) for s in ("train", "validation", "test")]
        rows.append([f, _num(st.get("occupancy")), _num(st.get("rows_used")), _num(st.get("evictions")), *share])
    return rows


# ---------------------------------------------------------------- compare


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def compare(run_a: str | Path, run_b: str | Path, *, max_config_diffs: int = 30) -> str:
    """Two runs side by side: headline numbers, final metrics, B - A deltas, plan, config.

    Raises:
        RunDirError: see :func:`load_run`.
    """
    a, b = load_run(run_a), load_run(run_b)
    ha, hb = headline(a), headline(b)
    rows = [["", "A", "B", "B - A"]]
    rows.append(["ranks", _num(ha["world_size"]), _num(hb["world_size"]), ""])
    for key, label, digits in (("steps", "steps", 0), ("rows", "rows trained", 0), ("samples_per_s", "samples/s", 1)):
        rows.append(
            [
                label,
                _num(ha[key], digits),
                _num(hb[key], digits),
                _delta(ha[key], hb[key], digits, pct=key == "samples_per_s"),
            ]
        )
    if a.stream or b.stream:
        (ta, qa, _), (tb, qb, _) = stream_state(a), stream_state(b)
        rows.append(["partitions trained", _num(len(ta)), _num(len(tb)), _delta(len(ta), len(tb), 0)])
        rows.append(["quarantined", _num(len(qa)), _num(len(qb)), _delta(len(qa), len(qb), 0)])
    finals_a, finals_b = _compared_metrics(a), _compared_metrics(b)
    wa, wb = weights_step(a), weights_step(b)
    if (wa is not None and wa != ha["steps"]) or (wb is not None and wb != hb["steps"]):
        rows.append(["weights of step", _num(wa), _num(wb), ""])  # validation and test: of these
    for split in dict.fromkeys([*finals_a, *finals_b]):
        fa, fb = finals_a.get(split, {}), finals_b.get(split, {})
        for k in EVAL_KEYS:
            rows.append([f"{split} {k}", _num(fa.get(k)), _num(fb.get(k)), _delta(fa.get(k), fb.get(k))])
    lines = [f"A {a.path}", f"B {b.path}", _table(rows)]
    if any(r[0] == "weights of step" for r in rows):
        lines.append(
            "  validation, test: scored with the weights of the step shown (the best validation's, put "
            "back by train.early_stopping.restore_best)"
        )
    if "progressive" in finals_a or "progressive" in finals_b:
        lines.append("  progressive: row-weighted means of the stream's per-partition progressive validation")
    plans = [
        ", ".join(f"{t} {n}" for t, n in sorted(Counter(e.get("sharding_type", "?") for e in r.plan).items()))
        if r.plan
        else "n/a"
        for r in (a, b)
    ]
    if plans[0] != plans[1]:
        lines.append(f"  plan: A {plans[0]}; B {plans[1]}")
    if a.config is not None and b.config is not None:
        fa, fb = _flatten(a.config), _flatten(b.config)
        diffs = [k for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]
        if diffs:
            lines.append("  config differences (A -> B):")
            lines += [f"    {k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in diffs[:max_config_diffs]]
            if len(diffs) > max_config_diffs:
                lines.append(f"    ... and {len(diffs) - max_config_diffs} more")
        else:
            lines.append("  config: identical")
    for tag, r in (("A", a), ("B", b)):
        if r.missing:
            lines.append(f"  {tag} missing: {', '.join(r.missing)}")
    return "\n".join(lines)


def _compared_metrics(run: Run) -> dict[str, dict]:
    """The metrics ``compare`` sets side by side: the test line and the validation of the same
    weights (the best validation's after early stopping restored them); for a stream run the
    pooled progressive validation (and test, if it has one)."""
    if not run.stream:
        return {"validation": scored_validation(run), "test": run.final("test")}
    out = {"progressive": progressive(partitions(run))}
    if run.final("test"):
        out["test"] = run.final("test")
    return out


# ---------------------------------------------------------------- command line


def cmd_report(args: argparse.Namespace) -> int:
    """``recsys-dist report``: exit code 0, 2 for a missing run directory or metrics.jsonl (the
    message names it), 1 when the plots cannot be written."""
    try:
        print(report(args.run_dir, plots=not args.no_plots, out_dir=args.out))
    except RunDirError as err:
        print(f"recsys-dist report: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"recsys-dist report: cannot write plots ({err}); use --out DIR or --no-plots", file=sys.stderr)
        return 1
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """``recsys-dist compare``: exit code 0, 2 for a missing run directory or metrics.jsonl."""
    try:
        print(compare(args.run_a, args.run_b))
    except RunDirError as err:
        print(f"recsys-dist compare: {err}", file=sys.stderr)
        return 2
    return 0
