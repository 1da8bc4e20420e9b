"""Dry-run planning: no process group, no GPU, any world size."""

import json

from tests.cli import run_cli
from tests.unit.distributed.test_planning import MLPERF


def test_plan_cli_64_gpus_json_and_failure_exit_code():
    cmd = ["plan", "--config", str(MLPERF)]
    r = run_cli(cmd + ["--world-size", "64", "--local-world-size", "8", "--hbm-gb", "80", "--json"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert len(out["hbm_gb"]) == 64 and len(out["placements"]) == 26
    r = run_cli(cmd + ["--world-size", "1", "--hbm-gb", "80"], timeout=300)
    assert r.returncode == 1 and "no sharding plan fits" in r.stderr
