"""Overlap under a network delay: base vs sparse_dist pipelines, fp32 vs fp16 comms, at world
size 2 on CPU (gloo), with and without a fixed delay per collective, optionally over a loopback
with a bandwidth cap in a network namespace of the benchmark's own.

    PYTHONPATH=. .venv/bin/python benchmarks/overlap_delay.py --delays 0 2 --reps 5 --out /tmp/overlap
    PYTHONPATH=. .venv/bin/python benchmarks/overlap_delay.py --netns --rate-mbit 200 --delays 0 2 --reps 5

All runs share one launch of 2 ranks (a fresh Trainer each), in alternating order over the
rounds; it prints each run, then medians and paired ratios per delay of the steady-state
samples/s (after the first logged window of 10 steps, which holds sparse_dist's one-time
trace and rewrite of the model; ``samples_per_s_all`` in each row counts the whole run), with the stage
times (base's forward holds its input_dist) and, for every run, the exposed communication per phase (ms per step the training thread
was blocked in collectives: recsys_dist.distributed.comm_counter.CommCounter.exposed).

The delay, by default, is injected inside the collectives by
recsys_dist.distributed.comm_counter.CommCounter(delay_ms=...): a collective's result arrives delay_ms after
the backend delivered it, as over a link with that latency. An asynchronous collective's wait()
(and its future) completes delay_ms after the backend completed it, so compute between issue and
wait can hide it (what a pipeline that issues early gains); a synchronous one sleeps delay_ms
after it returns. It applies to the collectives TorchRec issues (input_dist's splits, lengths
and ids all-to-alls, output_dist's all-to-all / reduce-scatter and their backward) and to DDP's
gradient all-reduce (through the future its comm hook waits on).

--netns --rate-mbit R re-executes the script under ``unshare --user --map-root-user --net``: a
new user and network namespace, unprivileged, that holds only its own loopback and goes away
when the script ends; the machine's interfaces are never touched (and the shaping refuses to
run where any interface besides lo is visible). There it sets lo's MTU to 1500 (so every
packet fits tbf's bucket), brings lo up and puts a qdisc at its root:

- netem, if the kernel has it (``--shaper auto|netem``): ``netem delay Xms rate Rmbit``; the
  delay is then on the wire (each packet, one way, ACKs included), set per run by rank 0 with
  ``tc qdisc change``, and CommCounter adds none;
- else (``--shaper auto|tbf``) ``tbf rate Rmbit burst B limit L`` with B = max(10 MTU, 1 ms
  at R) bytes (the tokens of 1 ms, at least ten full packets) and L = max(1 MiB, 100 ms at R)
  bytes of queue before tbf drops (a drop shows in the stats and is warned about): the cap is
  on the wire, the latency stays CommCounter's in-collective delay.

The ranks use GLOO_SOCKET_IFNAME=lo and the launcher's rendezvous store on localhost, and lo is
the only interface in the namespace, so every byte between the ranks (store, gloo, DDP's
all-reduce included) crosses the capped loopback. Both directions pass the one qdisc of lo, so
R caps the two ranks' traffic together (R/2 each way while both send). At world size 2
the quickstart's plan (``recsys-dist plan``, table_wise, batch 32/rank) puts ~330 KiB of payload
a step on lo (input_dist 10, output_dist 52 forward + 52 backward, DDP all-reduce 216), about
2.8/R seconds a step with R in Mbit/s (R = 200: ~14 ms). The script prints the commands it ran,
per run the bytes the qdisc carried, and ``tc -s qdisc show dev lo`` after the last run. If
unshare, ip or tc is missing, or the kernel refuses the namespace or the qdisc, it exits with
the reason (no run without the cap). semi_sync and fused_sparse_dist do not run on CPU
(recsys_dist/train/pipelines.py says why). Results:
benchmarks/results/overlap_delay_steady_cpu2core_20261202.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import harness
from netns import INSIDE_ENV, check_cmd, netem_change, qdisc_stats, reexec_in_netns, setup_netns

CASES = [("base", "fp32"), ("sparse_dist", "fp32"), ("sparse_dist", "fp16")]


def overrides_for(pipeline: str, prec: str, steps: int) -> list[str]:
    return [
        f"train.pipeline={pipeline}",
        f"sharding.comms.forward={prec}",
        f"sharding.comms.backward={prec}",
        "sharding.sharding_types=[table_wise]",
        f"train.max_steps={steps}",
        "train.timing_every_n_steps=10",
        "train.log_every_n_steps=10",
        "train.progress_bar=false",
        "checkpoint.enabled=false",
    ]


def job(config: str, out: str, delays: list[float], steps: int, reps: int, net: dict | None = None) -> list[dict]:
    """Every (delay, pipeline, comms) run ``reps`` times on this rank, in ABC..CBA order, each a
    fresh Trainer (which makes and closes its own process group) in the ranks of one launch.

    ``net`` (under --netns): {"shaper": "tbf" | "netem", "rate_mbit": R}. Under netem rank 0
    sets each run's delay on lo (``tc qdisc change``) before any rank trains, and CommCounter
    adds none; each row then also holds the bytes, packets and drops the qdisc counted during
    ``fit`` (both ranks' traffic, TCP headers and ACKs included) and the collectives' payload
    this rank sent (CommCounter's count)."""
    import warnings

    import torch.distributed as dist

    import recsys_dist
    from recsys_dist.config.loader import load_config
    from recsys_dist.distributed.comm_counter import CommCounter

    warnings.filterwarnings("ignore")
    wire_delay = net is not None and net["shaper"] == "netem"
    runs = [(d, p, c) for d in delays for p, c in CASES]
    rows = []
    for rep in range(reps):
        for delay, pipeline, prec in harness.abba_order(runs, rep):
            run_dir = Path(out) / f"r{rep}_d{delay:g}_{pipeline}_{prec}"
            cfg = load_config(config, overrides_for(pipeline, prec, steps))
            with recsys_dist.Trainer(cfg, run_dir) as trainer:
                if wire_delay:
                    if dist.get_rank() == 0:
                        check_cmd(netem_change(net["rate_mbit"], delay), quiet=True)
                    dist.barrier()
                before = qdisc_stats()[1] if net else {}
                with CommCounter(trainer.model, delay_ms=0.0 if wire_delay else delay) as counter:
                    summary = trainer.fit()
                world = dist.get_world_size()  # the Trainer's group, closed when it exits
                after = qdisc_stats()[1] if net else {}
            lines = harness.metrics(run_dir)
            times = [{k: v for k, v in r.items() if k.startswith("time_")} for r in lines if r.get("split") == "train"]
            times = [t for t in times if t]
            keys = sorted({k for t in times for k in t})
            row = {
                "rep": rep,
                "delay_ms": delay,
                "pipeline": pipeline,
                "comms": prec,
                # after the first logged window: it holds the pipeline's fill (sparse_dist's fx trace and
                # rewrite of the model, ~0.6 s on a fresh Trainer's first epoch; base has none)
                "samples_per_s": harness.steady_rate(lines, cfg.train.batch_size * world),
                "samples_per_s_all": summary["samples_per_s"],
                "mean_ms": {k: round(statistics.mean(t.get(k, 0) for t in times), 2) for k in keys},
                # ms per step this rank was blocked in collectives (CommCounter.exposed)
                "exposed_ms": {k: round(v * 1e3 / steps, 2) for k, v in counter.exposed.items() if v},
            }
            if net:
                row["delay_via"] = "netem" if wire_delay else "collectives"
                row["lo"] = {k: after.get(k, 0) - before.get(k, 0) for k in ("bytes", "packets", "dropped")}
                row["counted_sent_bytes"] = sum(c["sent"] for c in counter.counts.values())
            rows.append(row)
    return rows


def parse_args(argv: list[str]):
    ap = harness.parser(__doc__, "overlap_delay", "delay 0 only, 20 steps, 1 round")
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 2.0], help="ms added to every collective")
    ap.add_argument("--steps", type=int, default=200, help="training steps of each run")
    ap.add_argument("--reps", type=int, default=1, help="rounds, alternating the order of the runs")
    ap.add_argument("--out", default="/tmp/overlap", help="run directories and overlap.json")
    ap.add_argument("--config", default="configs/criteo_quickstart.yaml", help="the model and data (2 ranks)")
    ap.add_argument("--netns", action="store_true", help="run the ranks in a network namespace of their own")
    ap.add_argument("--rate-mbit", type=float, help="--netns: the loopback's bandwidth cap, Mbit/s")
    ap.add_argument(
        "--shaper",
        choices=("auto", "tbf", "netem"),
        help="--netns: netem (delay on the wire and the cap) or tbf (the cap; delay in the collectives); "
        "auto (default): netem when the kernel has it",
    )
    args = ap.parse_args(argv)
    if args.netns and (args.rate_mbit is None or args.rate_mbit <= 0):
        ap.error("--netns needs --rate-mbit R with R > 0 (the loopback's bandwidth cap, Mbit/s)")
    if not args.netns and (args.rate_mbit is not None or args.shaper is not None):
        ap.error("--rate-mbit and --shaper apply only with --netns")
    # refused here, before any rank starts: a bad value otherwise failed in the ranks after
    # the runs (too few log lines, no rounds to take a median of) or deep in a collective
    if any(not (0 <= d < float("inf")) for d in args.delays):
        ap.error(f"--delays must be finite numbers >= 0 (ms), got {args.delays}")
    if len(set(args.delays)) != len(args.delays):
        ap.error(f"--delays has a repeated value ({args.delays}); the runs of one delay share a run directory")
    if args.steps < 20:
        ap.error(f"--steps must be >= 20 (two logged windows of 10 steps; the first is left out), got {args.steps}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    args.shaper = args.shaper or "auto"
    if args.smoke:
        args.delays, args.steps, args.reps = [0.0], 20, 1
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.netns and not os.environ.get(INSIDE_ENV):
        sys.exit(reexec_in_netns(__file__, argv, args.rate_mbit))
    with harness.Results(args, argv):
        run(args)


def run(args) -> None:
    """Shape lo (under --netns), launch the runs, print each and the medians and paired ratios."""
    net = None
    if args.netns:
        net = {"shaper": setup_netns(args.rate_mbit, args.shaper, args.delays), "rate_mbit": args.rate_mbit}

    import recsys_dist

    rows = recsys_dist.launch(job, 2, args.config, args.out, args.delays, args.steps, args.reps, net)[0]
    for row in rows:
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "overlap.json").write_text(json.dumps(rows, indent=2))

    def rates(delay, pipeline, prec):
        got = [r for r in rows if (r["delay_ms"], r["pipeline"], r["comms"]) == (delay, pipeline, prec)]
        return [r["samples_per_s"] for r in sorted(got, key=lambda r: r["rep"])]

    print("\nmedian samples/s and paired ratios (median over rounds):")
    for delay in args.delays:
        base, sd, fp16 = (rates(delay, p, c) for p, c in CASES)
        med = {f"{p}/{c}": round(statistics.median(x)) for (p, c), x in zip(CASES, (base, sd, fp16))}
        ratio = {
            "sparse_dist/base": round(harness.paired_ratio(sd, base), 3),
            "fp16/fp32 (sparse_dist)": round(harness.paired_ratio(fp16, sd), 3),
        }
        print(f"delay {delay:g} ms: {med}  {ratio}")
        print(
            f"  95% bootstrap intervals of the paired ratios (rounds resampled): sparse_dist/base "
            f"{harness.ratio_interval(sd, base)}, fp16/fp32 (sparse_dist) {harness.ratio_interval(fp16, sd)}"
        )
        for p, c in CASES:
            got = [r for r in rows if (r["delay_ms"], r["pipeline"], r["comms"]) == (delay, p, c)]
            ms = [r["mean_ms"] for r in got]
            keys = sorted({k for m in ms for k in m})
            line = f"  {p}/{c} mean ms: " + ", ".join(
                f"{k[5:]} {statistics.median(m.get(k, 0) for m in ms):.2f}" for k in keys
            )
            exp = [r["exposed_ms"] for r in got]
            line += "; exposed comm ms/step: " + ", ".join(
                f"{k} {statistics.median(e.get(k, 0) for e in exp):.2f}" for k in sorted({k for e in exp for k in e})
            )
            if net:
                kb = statistics.median(r["lo"]["bytes"] for r in got) / args.steps / 1000
                line += f"; lo {kb:.1f} KB per step (fit's qdisc bytes / {args.steps} steps)"
            print(line)
    if net:
        text, total = qdisc_stats()
        print(f"\n$ tc -s qdisc show dev lo   (after the last run)\n{text.rstrip()}")
        print(
            f"the qdisc carried {total.get('bytes', 0)} bytes in {total.get('packets', 0)} packets "
            f"({total.get('overlimits', 0)} overlimits: packets that waited for the cap; "
            f"{total.get('dropped', 0)} dropped)"
        )
        if total.get("dropped"):
            print("WARNING: the qdisc dropped packets; TCP retransmits then slowed these runs beyond the cap")


if __name__ == "__main__":
    main()
