from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "criteo_quickstart.yaml"
CRITEO_SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(d))
    return d


def base_row(label="0", dense=None, cats=None) -> str:
    """A Criteo row: label, I1..I13 = 1..13, C1..C26 = 8-digit hex of 1..26 unless given."""
    dense = dense or [str(i) for i in range(1, 14)]
    cats = cats or [f"{i:08x}" for i in range(1, 27)]
    return "\t".join([label, *dense, *cats])


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """Undo what a test that runs CLI or benchmark code in this process did to logging (the
    root level set by `plan`, logging.disable in benchmarks/run.py): tests share a process."""
    import logging

    names = [None, "recsys_dist", "torchrec", "torch.distributed", "torch.distributed.elastic"]
    levels = {n: logging.getLogger(n).level for n in names}
    disabled = logging.root.manager.disable
    yield
    logging.disable(disabled)
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def pytest_configure(config):
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        # Test files run side by side (make test: pytest-xdist): one intra-op thread per
        # worker, or the workers' OpenMP pools fight over the cores.
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
