import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_criteo_pipeline_end_to_end(tmp_path):
    env = dict(os.environ, RECSYS_DIST_CACHE=str(tmp_path / "cache"))
    r = subprocess.run(
        [sys.executable, "pipelines/criteo_kaggle.py", "--run-dir", str(tmp_path / "run"), "data.num_rows=2000"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported model on the test split: AUC" in r.stdout
    assert Path(tmp_path / "run" / "test_predictions.parquet").is_file()
