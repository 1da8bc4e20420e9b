"""benchmarks/overlap_delay.py --netns without training: the tc commands it builds
(benchmarks/netns.py), its refusals (no unshare, a kernel that refuses the namespace, shaping
outside a namespace of its own; options without --netns, through its command line), and one real
unprivileged namespace whose capped loopback carries a TCP transfer (skipped, with the reason,
where the kernel refuses it)."""

from __future__ import annotations

import shutil

import pytest

from benchmarks import netns as od
from tests.conftest import ROOT


def test_tc_commands():
    assert od.LINK_COMMANDS == [["ip", "link", "set", "lo", "mtu", "1500"], ["ip", "link", "set", "lo", "up"]]
    # 100 Mbit/s: 1 ms of tokens is 12.5 KB < ten 1500-byte packets; 100 ms of queue 1.25 MB.
    assert od.qdisc_command(100, "tbf") == [
        *"tc qdisc add dev lo root tbf rate 100mbit burst 15000 limit 1250000".split(),
    ]
    # 1 Gbit/s: 1 ms of tokens is 125 KB; 8 Mbit/s: the 1 MiB floor of the queue.
    assert od.qdisc_command(1000, "tbf")[-4:] == ["burst", "125000", "limit", "12500000"]
    assert od.qdisc_command(8, "tbf")[-4:] == ["burst", "15000", "limit", str(1 << 20)]
    assert od.qdisc_command(250, "netem", 2) == [
        *"tc qdisc add dev lo root netem delay 2ms rate 250mbit limit 100000".split(),
    ]
    assert od.netem_change(250, 0.5) == [
        *"tc qdisc change dev lo root netem delay 0.5ms rate 250mbit limit 100000".split(),
    ]
    with pytest.raises(ValueError, match="rate_mbit"):
        od.qdisc_command(0, "tbf")
    with pytest.raises(ValueError, match="shaper"):
        od.qdisc_command(100, "htb")


def _which_but(monkeypatch, name: str, path: str | None) -> None:
    real = shutil.which
    monkeypatch.setattr(od.shutil, "which", lambda cmd, **kw: path if cmd == name else real(cmd, **kw))
    monkeypatch.delenv(od.INSIDE_ENV, raising=False)


SCRIPT = str(ROOT / "benchmarks" / "overlap_delay.py")


def test_refuses_without_unshare(monkeypatch):
    _which_but(monkeypatch, "unshare", None)
    with pytest.raises(SystemExit) as info:
        od.reexec_in_netns(SCRIPT, ["--netns", "--rate-mbit", "100", "--delays", "0"], 100)
    msg = str(info.value.code)
    assert "unshare not found" in msg and "run without --netns" in msg, msg
