"""The torch-free table of the shipped losses (``recsys_dist.models.config.SHIPPED_LOSSES``, read by the
``train.loss`` config check) equals the shipped losses' signatures."""

import subprocess
import sys

from tests.conftest import ROOT


def test_checking_train_loss_imports_no_torch():
    code = (
        "import sys; from recsys_dist.train.config import TrainConfig; "
        "TrainConfig(loss='focal', loss_args={'gamma': 1.0}); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
