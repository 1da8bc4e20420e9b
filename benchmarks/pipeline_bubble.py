"""The pipeline schedules' bubble: measured idle fraction of the stage ranks against theory (issue 38).

S ranks (gloo, one thread each) run a tower of ``--layers`` Linear+ReLU layers of width
``--width`` on a pipeline batch of ``--rows`` rows through torch.distributed.pipelining's
schedules, as ``distributed.dense.strategy: pipeline`` builds them
(``recsys_dist.distributed.stages``: loop placement, ``scale_grads``): gpipe and 1f1b (S stages,
one a rank), interleaved_1f1b and zero_bubble (S x v stages, v a rank), each at several
microbatch counts m. Per step, each rank's busy time is the wall time inside its stages'
``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` (the compute;
the schedule's waits for send / recv are outside them); idle = 1 - busy / step. Theory (equal
stages, free communication): gpipe and 1f1b idle (S - 1) / (m + S - 1); interleaved 1F1B
(Narayanan et al. 2021) (S - 1) / (v m + S - 1), each chunk's forward and backward 1/v of a
stage's; zero bubble: no closed form given here (ZB1P fills the bubble with the weights'
backward when F, B and W are equal; its number is printed against interleaved's).

All configurations run inside one pair of processes, in interleaved rounds (ABBA order, the
same order on every rank), ``--steps`` measured steps each per round after one warm-up, so the
machine's load (shared cores) weighs on every contender alike; the table gives the median over
rounds and steps of the ranks' mean idle fraction. Only the schedule's step is timed: the
trainer's step adds the gather / scatter / broadcast around it (``recsys_dist/train/stage_pipeline.py``).
Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/pipeline_bubble.py``.
"""

from __future__ import annotations

import time

import harness

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def theory(schedule: str, ranks: int, per_rank: int, m: int) -> float | None:
    """The idle fraction of a rank with equal stages and free communication (None: zero_bubble)."""
    if schedule in ("gpipe", "1f1b"):
        return (ranks - 1) / (m + ranks - 1)
    if schedule == "interleaved_1f1b":
        return (ranks - 1) / (per_rank * m + ranks - 1)
    return None


def contenders(microbatches: list[int], per_rank: int, ranks: int) -> list[tuple[str, int]]:
    """(schedule, m) pairs; 1f1b needs m >= S (torch), the interleaved ones torch's rounds rule."""
    out = []
    for schedule in SCHEDULES:
        for m in microbatches:
            if schedule == "1f1b" and m < ranks:
                continue
            if schedule in ("interleaved_1f1b", "zero_bubble") and m % max(1, m // ranks):
                continue
            out.append((schedule, m))
    return out


def _build(rank: int, ranks: int, schedule: str, m: int, per_rank: int, layers: int, width: int, seed: int):
    """This rank's schedule over its stages, and the list its stages log (kind, seconds) into."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from recsys_dist.distributed.stages import MULTI_SCHEDULES, SCHEDULES

    v = per_rank if schedule in MULTI_SCHEDULES else 1
    n = ranks * v
    if layers % n:
        raise SystemExit(f"--layers {layers} must be a multiple of the stages ({ranks} x {v})")
    torch.manual_seed(seed)
    tower = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    per = layers // n
    log: list[tuple[str, float]] = []
    stages = []
    for k in range(rank, n, ranks):  # loop placement: stages rank, rank + S, ...
        stage = PipelineStage(nn.Sequential(*tower[k * per : (k + 1) * per]), k, n, torch.device("cpu"))
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, _timed(getattr(stage, name), k, log))
        stages.append(stage)

    def loss(out, target):
        return ((out - target) ** 2).mean()

    if schedule in MULTI_SCHEDULES:
        return MULTI_SCHEDULES[schedule](stages, m, loss_fn=loss, scale_grads=True), log
    return SCHEDULES[schedule](stages[0], m, loss_fn=loss, scale_grads=True), log


def _timed(fn, stage: int, log: list):
    """``fn`` (a stage's compute on one microbatch) logging (kind, stage, microbatch, wall s, CPU
    s of this thread): kind F (forward), B (full backward), I (the input's gradient only: zero
    bubble), W (the weights' gradient)."""

    def timed(*args, **kwargs):
        mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
        if fn.__name__ == "forward_one_chunk":
            kind = "F"
        elif fn.__name__ == "backward_weight_one_chunk":
            kind = "W"
        else:
            kind = "B" if kwargs.get("full_backward", True) else "I"
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            log.append((kind, stage, mb, time.perf_counter() - t, time.thread_time() - c))

    return timed


UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # equal stages, a backward twice a forward


def replay(logs: list[list[tuple]], unit: bool = False) -> list[float]:
    """Each rank's idle fraction when the actions of ``logs`` (per rank, in the order it ran
    them: (kind, stage, microbatch, wall s, CPU s)) take their measured CPU time (which a
    descheduled rank does not accrue; ``unit``: :data:`UNIT` instead) and a message arrives at once: a
    stage's forward waits for the previous stage's, a backward (B or I) for the next stage's
    (the last stage's for its own forward), a W for its I; a rank runs its actions in its order.
    So it is the bubble the schedule's order makes with these costs, free of the machine's load."""
    done: dict[tuple, float] = {}
    last = max(a[1] for log in logs for a in log)
    pos, free, busy = [0] * len(logs), [0.0] * len(logs), [0.0] * len(logs)
    while any(p < len(log) for p, log in zip(pos, logs, strict=True)):
        moved = False
        for r, log in enumerate(logs):
            while pos[r] < len(log):
                kind, k, mb = log[pos[r]][:3]
                if kind == "F":
                    dep = ("F", k - 1, mb) if k > 0 else None
                elif kind == "W":
                    dep = ("I", k, mb)
                else:
                    dep = ("G", k + 1, mb) if k < last else ("F", k, mb)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done.get(dep, 0.0))
                cost = UNIT[kind] if unit else log[pos[r]][4]
                free[r] = start + cost
                busy[r] += cost
                done[(kind, k, mb)] = free[r]
                if kind in ("B", "I"):  # the gradient sent to the previous stage
                    done[("G", k, mb)] = free[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("replay: the logged orders wait on each other (a dependency not modelled)")
    span = max(free)
    return [1 - b / span for b in busy]


def worker(rank: int, world_size: int, order: list, opts: dict) -> dict:
    """One rank: for each (round, schedule, m) of ``order``, ``opts['steps']`` timed steps after
    one warm-up; per contender its (idle fraction, step seconds) per step."""
    import torch
    import torch.distributed as dist

    built, out = {}, {}
    x = torch.randn(opts["rows"], opts["width"])
    target = torch.randn(opts["rows"], opts["width"])
    for _round, schedule, m in order:
        key = (schedule, m)
        if key not in built:
            built[key] = _build(
                rank, world_size, schedule, m, opts["per_rank"], opts["layers"], opts["width"], opts["seed"]
            )
            _step(built[key][0], rank, world_size, x, target)  # warm-up: torch's shape exchange
        sched, log = built[key]
        for _ in range(opts["steps"]):
            dist.barrier()
            log.clear()
            t = time.perf_counter()
            _step(sched, rank, world_size, x, target)
            step = time.perf_counter() - t
            out.setdefault(key, []).append((step, list(log)))
    return out


def _step(sched, rank: int, ranks: int, x, target) -> None:
    if rank == 0:
        sched.step(x.clone().requires_grad_())
    elif rank == ranks - 1:
        sched.step(target=target, losses=[])
    else:
        sched.step()


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "pipeline_bubble", "2 ranks, 8 layers of 64, 32 rows, 1 round of 1 step")
    p.add_argument("--ranks", default="2", help="S, ranks of the pipeline: comma-separated, one run each (default 2)")
    p.add_argument("--per-rank", type=int, default=2, help="v, stages per rank of the interleaved schedules")
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers (a multiple of S x v)")
    p.add_argument("--width", type=int, default=768, help="the layers' width")
    p.add_argument("--rows", type=int, default=768, help="the pipeline batch's rows (a multiple of every m)")
    p.add_argument("--microbatches", default="2,4,8", help="comma-separated m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per contender per round")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.rows, args.rounds, args.steps = 8, 64, 32, 1, 1
    ms = [int(m) for m in args.microbatches.split(",")]
    if any(args.rows % m for m in ms):
        raise SystemExit(f"--rows {args.rows} must be a multiple of every microbatch count {ms}")
    opts = {k: getattr(args, k) for k in ("steps", "per_rank", "layers", "width", "rows")} | {"seed": 0}
    with harness.Results(args, argv):
        from recsys_dist.testing import run_ranks

        for ranks in (int(s) for s in args.ranks.split(",")):
            names = contenders(ms, args.per_rank, ranks)
            order = [(r, *c) for r in range(args.rounds) for c in harness.abba_order(names, r)]
            t = time.perf_counter()
            per_rank = run_ranks(worker, ranks, order, opts, timeout_s=3600)
            print(
                f"S = {ranks} ranks, v = {args.per_rank} stages per rank (interleaved), {args.layers} layers of "
                f"{args.width}, {args.rows} rows a step, {args.rounds} rounds x {args.steps} steps; "
                f"{time.perf_counter() - t:.0f} s in all"
            )
            _table(names, per_rank, ranks, args.per_rank)
            print()


def _table(names, per_rank: list[dict], ranks: int, v: int) -> None:
    print()
    print(
        "| schedule | m | theory | torch's order, equal stages | replayed (measured CPU costs) | replayed / theory "
        "| wall idle (loaded machine) | step s | F : B CPU ms (stage 0) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for schedule, m in names:
        steps = list(zip(*(r[(schedule, m)] for r in per_rank), strict=True))  # per step: each rank's (s, log)
        replayed = harness.median([sum(replay([log for _, log in step])) / len(step) for step in steps])
        equal = sum(replay([log for _, log in steps[0]], unit=True)) / len(steps[0])
        wall = harness.median([sum(1 - sum(a[3] for a in log) / s for s, log in step) / len(step) for step in steps])
        span = harness.median([max(s for s, _ in step) for step in steps])
        f = harness.median([a[4] for step in steps for a in step[0][1] if a[0] == "F" and a[1] == 0]) * 1e3
        b = harness.median([a[4] for step in steps for a in step[0][1] if a[0] in ("B", "W") and a[1] == 0]) * 1e3
        th = theory(schedule, ranks, v, m)
        ratio = f"{replayed / th:.2f}" if th else "-"
        th_s = f"{th:.3f}" if th is not None else "-"
        print(
            f"| {schedule} | {m} | {th_s} | {equal:.3f} | {replayed:.3f} | {ratio} | {wall:.3f} | {span:.3f} "
            f"| {f:.0f} : {b:.0f} |"
        )


if __name__ == "__main__":
    main()
