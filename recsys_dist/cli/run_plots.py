"""The PNG plots of ``recsys-dist report``, from a run read by ``recsys_dist.cli.run_metrics``.

Drawn with matplotlib's Agg renderer through ``matplotlib.figure.Figure`` directly, never
pyplot, so no global backend is set in the caller's process.
"""

from __future__ import annotations

from pathlib import Path

from recsys_dist.cli.run_metrics import Run, partitions, plan_bytes_per_rank, plan_per_rank, time_keys, xy
from recsys_dist.files import write_atomic


def write_plots(run: Run, out_dir: Path) -> list[Path]:
    """Write the PNGs for which ``run`` has data; returns the paths written.

    ``loss.png`` (train loss vs step; with several tasks also each ``loss/<task>``),
    ``validation.png`` (validation AUC and logloss vs step, final test values as markers; not
    for a stream run), ``progressive.png`` (a stream run's progressive-validation AUC and
    logloss per partition), ``throughput.png`` (samples/s vs step),
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
        # a Figure renders PNG with Agg without pyplot; format: the temporary name ends in .tmp
        write_atomic(out_dir / name, lambda p: fig.savefig(p, dpi=110, format="png"))
        written.append(out_dir / name)

    for plot in (_plot_loss, _plot_validation, _plot_progressive, _plot_throughput, _plot_step_time, _plot_plan):
        plot(run, Figure, save)
    return written


def _plot_loss(run: Run, Figure, save) -> None:
    train = run.split("train")
    x, y = xy(train, "loss")
    if not x:
        return
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(x, y, marker="." if len(x) < 50 else None, label="loss")
    task_keys = list(dict.fromkeys(k for r in train for k in r if k.startswith("loss/")))
    for key in task_keys:  # several tasks: each task's own loss (before train.loss_weights)
        ax.plot(*xy(train, key), label=key)
    if task_keys:
        ax.legend()
    ax.set(title=f"training loss - {run.path.name}", xlabel="step", ylabel="loss (weighted mean, per row)")
    ax.grid(alpha=0.3)
    save(fig, "loss.png")


def _plot_validation(run: Run, Figure, save) -> None:
    val, test = run.split("validation"), run.final("test")
    if run.stream or not (val or test):  # a stream run's validation lines: progressive.png
        return
    fig = Figure(figsize=(10, 4))
    first = next((k.split("/")[0] + "/" for r in val + ([test] if test else []) for k in r if "/" in k), "")
    for i, (key, label) in enumerate((("auc", "AUC"), ("logloss", "logloss (nats)"))):
        key, label = first + key, (first + label if first else label)  # several tasks: the first's
        ax = fig.add_subplot(1, 2, i + 1)
        vx, vy = xy(val, key)
        if vx:
            ax.plot(vx, vy, marker="o", label="validation")
        if isinstance(test.get(key), (int, float)):
            # At the step of the weights it scored (the best validation's after restore_best).
            at = test.get("weights_step", test["step"])
            ax.plot([at], [test[key]], marker="*", markersize=12, linestyle="", label=f"test (weights of step {at})")
        ax.set(title=f"{label} vs step", xlabel="step", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, "validation.png")


def _plot_progressive(run: Run, Figure, save) -> None:
    """progressive.png: each partition's AUC and logloss before it was trained on, in order."""
    parts = [
        p
        for p in partitions(run)
        if isinstance(p.get("auc"), (int, float)) or isinstance(p.get("logloss"), (int, float))
    ]
    if not run.stream or not parts:
        return
    from matplotlib.ticker import MaxNLocator  # as write_plots: matplotlib only when drawing

    fig = Figure(figsize=(10, 4))
    x = list(range(1, len(parts) + 1))
    for i, (key, label) in enumerate((("auc", "AUC"), ("logloss", "logloss (nats)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        pts = [(n, p[key]) for n, p in zip(x, parts) if isinstance(p.get(key), (int, float))]
        ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o" if len(pts) <= 50 else None)
        ax.set(
            title=f"progressive {label} (before training on it)", xlabel="partition (in training order)", ylabel=label
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"{run.path.name}: {parts[0]['partition']} ... {parts[-1]['partition']}"
        if len(parts) > 1
        else f"{run.path.name}: {parts[0]['partition']}",
        fontsize=9,
    )
    save(fig, "progressive.png")


def _plot_throughput(run: Run, Figure, save) -> None:
    x, y = xy(run.split("train"), "samples_per_s")
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
    tkeys = time_keys(train)
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
    per_rank = plan_per_rank(run.plan)
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
    memory = plan_bytes_per_rank(run.plan)
    if memory:
        fig = Figure(figsize=(max(5, 0.5 * len(memory) + 3), 4))
        ax = fig.add_subplot()
        ax.bar([str(r) for r in memory], [b / 2**20 for b in memory.values()])
        ax.set(title="embedding weights per rank (fp32, from the plan)", xlabel="rank", ylabel="MiB")
        save(fig, "embedding_memory.png")
