"""Two nodes x one process on loopback through torchrun's c10d rendezvous."""

import json
import os
import subprocess
import sys

import pytest

from recsys_dist.testing import free_port
from tests.conftest import QUICKSTART, ROOT
from tests.e2e.test_quickstart import check_run_dir


@pytest.mark.slow
def test_two_nodes_one_process_each(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    env = dict(os.environ, RECSYS_DIST_CACHE=str(tmp_path / "cache"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=multinode-test",
        "-m",
        "recsys_dist.cli.main",
        "train",
        "--config",
        str(QUICKSTART),
        "--run-dir",
        str(run_dir),
        "data.num_rows=2000",
        "train.log_every_n_steps=5",
        "train.progress_bar=false",
    ]
    nodes = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert all(p.returncode == 0 for p in nodes), [o[1][-2000:] for o in outs]
    check_run_dir(run_dir, 2)
    # Each node has one local rank, so the plan spans two hosts.
    ranks = {r for row in json.loads((run_dir / "plan.json").read_text()) for r in row["ranks"]}
    assert ranks == {0, 1}
