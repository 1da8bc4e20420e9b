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

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CASES = [("base", "fp32"), ("sparse_dist", "fp32"), ("sparse_dist", "fp16")]

INSIDE_ENV = "RECSYS_DIST_OVERLAP_NETNS"  # set on the re-executed script inside the namespace
LO_MTU = 1500  # bytes; lo's own 65536 would exceed a small tbf bucket (tbf drops such packets)
TBF_MIN_LIMIT = 1 << 20  # bytes tbf queues at least before it drops (TCP's window on lo fills it)
SBIN = "/usr/sbin:/sbin"  # where ip and tc live when an unprivileged PATH lacks them


def tool(name: str) -> str | None:
    """The path of a command on $PATH or in /usr/sbin, /sbin; None when there is none."""
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + SBIN)


def tbf_burst_bytes(rate_mbit: float) -> int:
    """tbf's bucket: the tokens of 1 ms at ``rate_mbit`` Mbit/s, at least ten full packets."""
    return max(10 * LO_MTU, int(rate_mbit * 1e6 / 8 / 1000))


def tbf_limit_bytes(rate_mbit: float) -> int:
    """tbf's queue: 100 ms at ``rate_mbit`` Mbit/s, at least 1 MiB (a drop on lo costs a TCP
    retransmit, far more than the cap)."""
    return max(TBF_MIN_LIMIT, int(rate_mbit * 1e6 / 8 / 10))


LINK_COMMANDS = [["ip", "link", "set", "lo", "mtu", str(LO_MTU)], ["ip", "link", "set", "lo", "up"]]


def qdisc_command(rate_mbit: float, shaper: str, delay_ms: float = 0.0) -> list[str]:
    """The tc command that shapes lo inside the namespace: ``shaper`` "tbf" (a bandwidth cap
    of ``rate_mbit`` Mbit/s) or "netem" (``delay_ms`` on every packet, and the cap)."""
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
    if shaper == "tbf":
        qdisc = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(tbf_burst_bytes(rate_mbit))]
        qdisc += ["limit", str(tbf_limit_bytes(rate_mbit))]
    elif shaper == "netem":
        qdisc = netem_args(rate_mbit, delay_ms)
    else:
        raise ValueError(f"shaper must be tbf or netem, got {shaper!r}")
    return ["tc", "qdisc", "add", "dev", "lo", "root", *qdisc]


def netem_args(rate_mbit: float, delay_ms: float) -> list[str]:
    return ["netem", "delay", f"{delay_ms:g}ms", "rate", f"{rate_mbit:g}mbit", "limit", "100000"]


def netem_change(rate_mbit: float, delay_ms: float) -> list[str]:
    """The command rank 0 runs before each run under netem to set that run's delay."""
    return ["tc", "qdisc", "change", "dev", "lo", "root", *netem_args(rate_mbit, delay_ms)]


def run_cmd(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` (its first word looked up by :func:`tool`) and capture its output."""
    path = tool(cmd[0]) or cmd[0]
    return subprocess.run([path, *cmd[1:]], capture_output=True, text=True, check=False)


def qdisc_stats() -> tuple[str, dict]:
    """``tc -s qdisc show dev lo``: its text and the root qdisc's counters
    {"bytes", "packets", "dropped", "overlimits"} (overlimits: packets that had to wait)."""
    text = run_cmd(["tc", "-s", "qdisc", "show", "dev", "lo"]).stdout
    m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
    keys = ("bytes", "packets", "dropped", "overlimits")
    return text, dict(zip(keys, map(int, m.groups()))) if m else {}


def probe_netns(rate_mbit: float) -> str | None:
    """None when an unprivileged user+network namespace with a tbf qdisc on its lo works here,
    else why not (the tool's error). Cheap: no Python, no torch in the namespace."""
    cmds = [*LINK_COMMANDS, qdisc_command(rate_mbit, "tbf")]
    shell = " && ".join(shlex.join([tool(c[0]) or c[0], *c[1:]]) for c in cmds)
    unshare = tool("unshare") or "unshare"
    try:
        done = subprocess.run(
            [unshare, "--user", "--map-root-user", "--net", "--", "sh", "-c", shell],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if done.returncode:
        return (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
    return None


def reexec_in_netns(argv: list[str], rate_mbit: float) -> int:
    """Run this script again with ``argv`` in a new user+network namespace; its exit status.

    Raises:
        SystemExit: unshare, ip or tc missing, or the kernel refuses the namespace or tbf.
    """
    missing = [name for name in ("unshare", "ip", "tc") if tool(name) is None]
    if missing:
        raise SystemExit(
            f"overlap_delay.py --netns: {', '.join(missing)} not found on PATH or in {SBIN} (unshare is in "
            "util-linux, ip and tc in iproute2). Install them, or run without --netns (then the delay is "
            "inside the collectives and nothing caps the bandwidth)."
        )
    problem = probe_netns(rate_mbit)
    if problem:
        raise SystemExit(
            "overlap_delay.py --netns: this machine refused an unprivileged user+network namespace with a "
            f"tbf qdisc on its loopback ({problem}); no run without the cap. Unprivileged user namespaces "
            "may be off (sysctl kernel.unprivileged_userns_clone, user.max_user_namespaces) or the kernel "
            "lacks sch_tbf; run without --netns for the in-collective delay only."
        )
    cmd = [tool("unshare"), "--user", "--map-root-user", "--net", "--", sys.executable, os.path.abspath(__file__)]
    return subprocess.call([*cmd, *argv], env=dict(os.environ, **{INSIDE_ENV: "1"}))


def interfaces() -> list[str]:
    """The network interfaces this process sees (``ip -o link show``)."""
    out = run_cmd(["ip", "-o", "link", "show"]).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def setup_netns(rate_mbit: float, shaper: str, delays: list[float]) -> str:
    """Inside the namespace: shape lo, print each command; returns the shaper used ("tbf" or
    "netem"). ``shaper`` "auto" takes netem when the kernel has it, tbf otherwise.

    Raises:
        SystemExit: any interface besides lo is visible (not a fresh namespace: the machine's
            own interfaces are never shaped), or a command fails (no run without the cap).
    """
    seen = interfaces()
    if seen != ["lo"]:
        raise SystemExit(
            f"overlap_delay.py: refusing to shape: this process sees the interfaces {seen}, not lo alone, "
            "so it is not in a network namespace of its own (--netns re-executes the script under unshare)"
        )
    for cmd in LINK_COMMANDS:
        check_cmd(cmd)
    for kind in ("netem", "tbf") if shaper == "auto" else (shaper,):
        cmd = qdisc_command(rate_mbit, kind, delays[0])
        done = run_cmd(cmd)
        if shaper == "auto" and kind == "netem" and done.returncode and "unknown" in done.stderr.lower():
            print(f"netns: netem unavailable (`{shlex.join(cmd)}`: {done.stderr.strip()})", flush=True)
            continue
        check_cmd(cmd, done)
        chosen = kind
        break
    if chosen == "netem":
        print(
            f"netns: latency on the wire (netem delay), bandwidth {rate_mbit:g} Mbit/s; before each run rank 0 runs",
            flush=True,
        )
        for delay in delays:
            print(f"netns:   {shlex.join(netem_change(rate_mbit, delay))}", flush=True)
    else:
        print(f"netns: latency in the collectives (CommCounter), bandwidth {rate_mbit:g} Mbit/s (tbf)", flush=True)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks inherit it
    return chosen


def check_cmd(cmd: list[str], done: subprocess.CompletedProcess | None = None, quiet: bool = False) -> None:
    """Print ``cmd`` (unless ``quiet``), run it (unless ``done`` holds its result); exit when
    it failed."""
    done = done or run_cmd(cmd)
    if not quiet:
        print(f"netns: {shlex.join(cmd)}", flush=True)
    if done.returncode:
        raise SystemExit(f"overlap_delay.py: `{shlex.join(cmd)}` failed: {done.stderr.strip()}; no run without the cap")


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
        for delay, pipeline, prec in runs if rep % 2 == 0 else runs[::-1]:
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
            lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
            times = [{k: v for k, v in r.items() if k.startswith("time_")} for r in lines if r.get("split") == "train"]
            times = [t for t in times if t]
            keys = sorted({k for t in times for k in t})
            row = {
                "rep": rep,
                "delay_ms": delay,
                "pipeline": pipeline,
                "comms": prec,
                "samples_per_s": steady_rate(lines, cfg.train.batch_size * world),
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


def steady_rate(lines: list[dict], global_batch: int) -> float:
    """Samples/s of a run's training after its first logged window: that window holds the
    pipeline's fill (sparse_dist's fx trace and rewrite of the model, ~0.6 s on the first epoch
    of a fresh Trainer; base has none), a one-time cost that is not the overlap measured here.
    From the train lines' per-window ``samples_per_s`` and step counts."""
    train = [r for r in lines if r.get("split") == "train" and r.get("samples_per_s")]
    rows = secs = 0.0
    for prev, cur in zip(train, train[1:]):
        n = (cur["step"] - prev["step"]) * global_batch
        rows, secs = rows + n, secs + n / cur["samples_per_s"]
    if not secs:
        raise SystemExit("overlap_delay.py: fewer than two train log lines; raise --steps")
    return round(rows / secs, 1)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
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
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.netns and not os.environ.get(INSIDE_ENV):
        sys.exit(reexec_in_netns(argv, args.rate_mbit))
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
            "sparse_dist/base": round(statistics.median(b / a for a, b in zip(base, sd)), 3),
            "fp16/fp32 (sparse_dist)": round(statistics.median(b / a for a, b in zip(sd, fp16)), 3),
        }
        print(f"delay {delay:g} ms: {med}  {ratio}")
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
