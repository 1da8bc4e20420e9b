"""The network namespace of ``benchmarks/overlap_delay.py --netns``: an unprivileged user+network
namespace holding only its own loopback, capped by a tbf or netem qdisc (the tc commands, the
probe, the re-execution under ``unshare``, the shaping and its counters). The machine's own
interfaces are never shaped: :func:`setup_netns` refuses where any interface besides lo is
visible. What it does and why: overlap_delay.py's module doc, docs/benchmarks.md.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

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


def reexec_in_netns(script: str, argv: list[str], rate_mbit: float) -> int:
    """Run ``script`` again with ``argv`` in a new user+network namespace (``INSIDE_ENV`` set);
    its exit status.

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
    cmd = [tool("unshare"), "--user", "--map-root-user", "--net", "--", sys.executable, os.path.abspath(script)]
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
