"""Evaluating 30 million predictions with the streaming metrics uses bounded memory."""

import json
import subprocess
import sys

from tests.conftest import ROOT

# One fresh process per size, so its peak RSS is this evaluation's alone (in the test process
# the peak left by earlier tests would hide any growth).
EVAL = """
import json, resource, sys, torch
from recsys_dist.train.metrics import StreamingBinaryMetrics
rows, chunk = int(sys.argv[1]), 1_000_000
g = torch.Generator().manual_seed(0)
m = StreamingBinaryMetrics()
for _ in range(rows // chunk):  # one evaluation batch of 10^6 at a time
    labels = (torch.rand(chunk, generator=g) < 0.25).float()
    m.update(torch.randn(chunk, generator=g) + 2.0 * labels, labels)
out = m.compute()
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "state": m.state.numel(), "n": out["num_examples"], "auc": out["auc"],
                  "bound": out["auc_error_bound"]}))
"""


def _evaluate(rows: int) -> dict:
    r = subprocess.run([sys.executable, "-c", EVAL, str(rows)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_thirty_million_predictions_in_bounded_memory():
    # From 3 chunks on, the allocator has what one chunk's temporaries need (1, 3, 10, 30 million
    # rows peaked at 290, 321, 336, 329 MB), so 3 vs 30 million compares like with like.
    small, big = _evaluate(3_000_000), _evaluate(30_000_000)
    assert big["n"] == 30_000_000 and big["state"] == small["state"]
    # 10x the predictions, the same peak (an exact AUC would hold the 3*10^7 logits and labels:
    # +240 MB).
    assert big["peak_mb"] < small["peak_mb"] * 1.1, (small, big)
    # Two unit-variance normals 2 apart: AUC = Phi(2 / sqrt 2) = 0.9214.
    assert abs(big["auc"] - 0.9214) < 2e-3 and big["bound"] < 1e-3
