"""Read a run directory back: a text summary, PNG plots, and a side-by-side comparison.

    recsys-dist report RUN_DIR [--no-plots] [--out DIR]
    recsys-dist compare RUN_A RUN_B

Inputs (written by ``recsys_dist.train.trainer``): ``metrics.jsonl`` (required), ``summary.json``,
``plan.json`` and ``config.yaml`` (each optional: a run that died early has only some).
Plots are drawn with matplotlib's Agg renderer through ``matplotlib.figure.Figure``
directly, never pyplot, so no global backend is set in the caller's process.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from recsys_dist.errors import RunDirError  # noqa: F401 (raised here; defined in errors)

EVAL_KEYS = ("auc", "logloss", "ne", "calibration", "accuracy")
# Train-line keys of the step-time breakdown, in pipeline order; other time_*_ms keys follow.
TIME_KEYS = ("time_data_ms", "time_forward_ms", "time_backward_ms", "time_optimizer_ms")


SPLIT_NAMES = ("train", "validation", "test", "ledger")


@dataclass
class Run:
    """One run directory, parsed. ``records`` are metrics.jsonl lines in file order."""

    path: Path
    records: list[dict]
    bad_lines: int = 0
    summary: dict | None = None
    plan: list | None = None
    config: dict | None = None
    missing: list[str] = field(default_factory=list)

    def split(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("split") == name]

    def final(self, name: str) -> dict:
        """The last record of a split ({} when none)."""
        lines = self.split(name)
        return lines[-1] if lines else {}


def load_run(run_dir: str | Path) -> Run:
    """Parse a run directory.

    Raises:
        RunDirError: the directory or its ``metrics.jsonl`` does not exist, or an
            optional JSON file exists but is not valid JSON.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"run directory {path} does not exist")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise RunDirError(f"{metrics} is missing (not a run directory, or the run wrote no metrics yet)")
    records, bad = [], 0
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # e.g. a last line cut short by a crash; the rest is still worth a report
            continue
        # A line whose step is not a number (hand-edited, say) is unreadable like a cut one.
        if isinstance(rec, dict) and isinstance(rec.get("step", 0), int) and rec.get("split", "train") in SPLIT_NAMES:
            records.append(rec)
        else:
            bad += 1
    run = Run(path, records, bad)
    for name, attr, kind in (("summary.json", "summary", dict), ("plan.json", "plan", list)):
        f = path / name
        if not f.is_file():
            run.missing.append(name)
            continue
        try:
            value = json.loads(f.read_text())
        except json.JSONDecodeError as err:
            raise RunDirError(f"{f} is not valid JSON ({err})") from None
        if not isinstance(value, kind):
            raise RunDirError(f"{f} holds a {type(value).__name__}, not the JSON {kind.__name__} recsys-dist writes")
        setattr(run, attr, value)
    if (path / "config.yaml").is_file():
        import yaml

        run.config = yaml.safe_load((path / "config.yaml").read_text())
    return run


# ---------------------------------------------------------------- formatting


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


def _time_keys(train: list[dict]) -> list[str]:
    present = {k for r in train for k in r if k.startswith("time_") and k.endswith("_ms")}
    return [k for k in TIME_KEYS if k in present] + sorted(present - set(TIME_KEYS))


def _headline(run: Run) -> dict:
    """steps, rows, samples/s, world size: from summary.json, else what metrics.jsonl shows."""
    s = run.summary or {}
    steps = s.get("steps")
    if steps is None and run.records:
        steps = max((r.get("step") or 0) for r in run.records)
    return {
        "steps": steps,
        "rows": s.get("rows_trained"),
        "samples_per_s": s.get("samples_per_s"),
        "world_size": s.get("world_size"),
    }


def _plan_bytes_per_rank(plan: list) -> dict[int, int]:
    """rank -> bytes of fp32 embedding weights held there (from plan.json's ``rank_bytes``)."""
    out: dict[int, int] = {}
    for entry in plan:
        for r, b in (entry.get("rank_bytes") or {}).items():
            out[int(r)] = out.get(int(r), 0) + int(b)
    return dict(sorted(out.items()))


def _plan_per_rank(plan: list) -> dict[int, Counter]:
    """rank -> Counter(sharding_type -> number of tables with a shard or replica there)."""
    per_rank: dict[int, Counter] = {}
    for entry in plan:
        for r in entry.get("ranks") or []:
            per_rank.setdefault(int(r), Counter())[entry.get("sharding_type", "?")] += 1
    return dict(sorted(per_rank.items()))


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
    h = _headline(run)
    lines = [f"run {run.path}"]
    lines.append(
        f"  steps {_num(h['steps'])}  rows trained {_num(h['rows'])}  "
        f"samples/s {_num(h['samples_per_s'], 1)}  ranks {_num(h['world_size'])}"
    )
    finals = {split: run.final(split) for split in ("validation", "test")}
    lines.append(_table(_metric_rows(finals)))
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
        remap_ms = _mean([r.get("managed_remap_ms_per_step") for r in train])
        if remap_ms is not None:
            lines.append(f"    remapping {_num(remap_ms, 2)} ms per step (in the forward time; all_gather included)")
    tkeys = _time_keys(train)
    if tkeys:
        means = {k: _mean([r.get(k) for r in train]) for k in tkeys}
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
    per_rank = _plan_per_rank(plan)
    memory = _plan_bytes_per_rank(plan)
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
    if any(sent(row, "managed_all_gather") for row in ledger["per_rank"]):  # managed-collision tables
        phases += ("managed_all_gather",)
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
    last train window, validation and test lookups (``managed`` in metrics.jsonl)."""
    last = {s: run.final(s).get("managed") or {} for s in ("train", "validation", "test")}
    end = last["test"] or last["validation"] or last["train"]
    if not end:
        return []
    rows = [["feature", "occupancy", "rows used", "evictions", "default: train", "validation", "test"]]
    for f, st in end.items():
        share = [_num((last[s].get(f) or {}).get("default_share")) for s in ("train", "validation", "test")]
        rows.append([f, _num(st.get("occupancy")), _num(st.get("rows_used")), _num(st.get("evictions")), *share])
    return rows


def _mean(values: list) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def _xy(records: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and r.get("step") is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_plots(run: Run, out_dir: Path) -> list[Path]:
    """Write the PNGs for which ``run`` has data; returns the paths written.

    ``loss.png`` (train loss vs step; with several tasks also each ``loss/<task>``), ``validation.png`` (validation AUC and logloss vs
    step, final test values as markers), ``throughput.png`` (samples/s vs step),
    ``step_time.png`` (mean ms per phase from train-line ``time_*_ms`` keys, stacked; only
    when present), ``plan.png`` (tables per rank by sharding type; only with plan.json).

    Raises:
        OSError: ``out_dir`` cannot be created or written.
    """
    # matplotlib loads only when plots are drawn (`report --no-plots` and `compare` never draw).
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name: str, integer_y: bool = False) -> None:
        for ax in fig.axes:
            if ax.get_xlabel() == "step" and not ax.patches:  # bar charts label their own ticks
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if integer_y:
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)  # a Figure renders PNG with Agg without pyplot
        written.append(out_dir / name)

    for plot in (_plot_loss, _plot_validation, _plot_throughput, _plot_step_time, _plot_plan):
        plot(run, Figure, save)
    return written


def _plot_loss(run: Run, Figure, save) -> None:
    train = run.split("train")
    x, y = _xy(train, "loss")
    if not x:
        return
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(x, y, marker="." if len(x) < 50 else None, label="loss")
    task_keys = list(dict.fromkeys(k for r in train for k in r if k.startswith("loss/")))
    for key in task_keys:  # several tasks: each task's own loss (before train.loss_weights)
        ax.plot(*_xy(train, key), label=key)
    if task_keys:
        ax.legend()
    ax.set(title=f"training loss - {run.path.name}", xlabel="step", ylabel="loss (weighted mean, per row)")
    ax.grid(alpha=0.3)
    save(fig, "loss.png")


def _plot_validation(run: Run, Figure, save) -> None:
    val, test = run.split("validation"), run.final("test")
    if not (val or test):
        return
    fig = Figure(figsize=(10, 4))
    first = next((k.split("/")[0] + "/" for r in val + ([test] if test else []) for k in r if "/" in k), "")
    for i, (key, label) in enumerate((("auc", "AUC"), ("logloss", "logloss (nats)"))):
        key, label = first + key, (first + label if first else label)  # several tasks: the first's
        ax = fig.add_subplot(1, 2, i + 1)
        vx, vy = _xy(val, key)
        if vx:
            ax.plot(vx, vy, marker="o", label="validation")
        if isinstance(test.get(key), (int, float)):
            ax.plot([test["step"]], [test[key]], marker="*", markersize=12, linestyle="", label="test (final)")
        ax.set(title=f"{label} vs step", xlabel="step", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, "validation.png")


def _plot_throughput(run: Run, Figure, save) -> None:
    x, y = _xy(run.split("train"), "samples_per_s")
    if not x:
        return
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(x, y, marker="." if len(x) < 50 else None)
    ax.set(title="throughput (all ranks, real rows)", xlabel="step", ylabel="samples/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    save(fig, "throughput.png")


def _plot_step_time(run: Run, Figure, save) -> None:
    train = run.split("train")
    tkeys = _time_keys(train)
    if not tkeys:
        return
    steps = [r["step"] for r in train if r.get("step") is not None]
    series = [
        [r.get(k) if isinstance(r.get(k), (int, float)) else 0.0 for r in train if r.get("step") is not None]
        for k in tkeys
    ]
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    labels = [k[5:-3] for k in tkeys]
    if len(steps) <= 60:  # bars stay readable; beyond that a stacked area does
        pos = list(range(len(steps)))
        bottom = [0.0] * len(steps)
        for vals, lab in zip(series, labels):
            ax.bar(pos, vals, bottom=bottom, label=lab)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ticks = pos[:: max(1, len(pos) // 12)]
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    else:
        ax.stackplot(steps, series, labels=labels)
    ax.set(title="step time breakdown (mean per step over each log interval)", xlabel="step", ylabel="ms")
    top = max((sum(col) for col in zip(*series)), default=0.0)
    if top > 0:
        ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(loc="upper center", ncol=min(4, len(labels)))
    save(fig, "step_time.png")


def _plot_plan(run: Run, Figure, save) -> None:
    """plan.png (tables per rank by sharding type) and embedding_memory.png, from plan.json."""
    if not run.plan:
        return
    per_rank = _plan_per_rank(run.plan)
    if per_rank:
        types = sorted({t for c in per_rank.values() for t in c})
        ranks = list(per_rank)
        fig = Figure(figsize=(max(5, 0.5 * len(ranks) + 3), 4))
        ax = fig.add_subplot()
        bottom = [0] * len(ranks)
        for t in types:
            vals = [per_rank[r][t] for r in ranks]
            ax.bar([str(r) for r in ranks], vals, bottom=bottom, label=t)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set(
            title=f"tables per rank ({len(run.plan)} tables)", xlabel="rank", ylabel="tables with a shard or replica"
        )
        ax.set_ylim(top=max(bottom) * 1.3)  # room for the legend above the bars
        ax.legend(ncol=min(3, len(types)), loc="upper center")
        save(fig, "plan.png", integer_y=True)  # whole tables
    memory = _plan_bytes_per_rank(run.plan)
    if memory:
        fig = Figure(figsize=(max(5, 0.5 * len(memory) + 3), 4))
        ax = fig.add_subplot()
        ax.bar([str(r) for r in memory], [b / 2**20 for b in memory.values()])
        ax.set(title="embedding weights per rank (fp32, from the plan)", xlabel="rank", ylabel="MiB")
        save(fig, "embedding_memory.png")


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
    ha, hb = _headline(a), _headline(b)
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
    for split in ("validation", "test"):
        fa, fb = a.final(split), b.final(split)
        for k in EVAL_KEYS:
            rows.append([f"{split} {k}", _num(fa.get(k)), _num(fb.get(k)), _delta(fa.get(k), fb.get(k))])
    lines = [f"A {a.path}", f"B {b.path}", _table(rows)]
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
