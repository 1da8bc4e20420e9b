"""``data.config`` is a section config: validating a ``data`` section loads no format module
(pyarrow); the checks that need the format run from ``RunConfig`` (``data.resolve.check_data``)."""

import os
import subprocess
import sys

CHECK = """
import sys
from recsys_dist.data.config import DataConfig
DataConfig(num_embeddings=[5, 6], categorical_mapping="managed", managed={"eviction_interval": 1})
bad = sorted(m for m in sys.modules if m.startswith("recsys_dist.data.") and m not in ("recsys_dist.data.config", "recsys_dist.data.split_config"))
assert not bad and "pyarrow" not in sys.modules, (bad, "pyarrow" in sys.modules)
"""


def test_data_section_loads_no_format():
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", CHECK], check=True, env=env)
