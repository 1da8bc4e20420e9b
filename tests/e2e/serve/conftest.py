"""Small trained runs shared by the serving tests (each trained once per session, 1 rank)."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.cli import run_cli
from tests.conftest import CRITEO_SAMPLE, QUICKSTART, ROOT

MOVIELENS = ROOT / "datasets" / "movielens" / "ratings_genres_first20000.csv"
ONE_RANK = ["distributed.nproc_per_node=1", "train.progress_bar=false", "checkpoint.enabled=true"]


def cli(args, tmp, check=True):
    """``recsys-dist ARGS`` (tests.cli.run_cli), conversions cached under ``tmp/cache``."""
    r = run_cli(args, tmp)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def predictions(path):
    return pq.read_table(path)


def logits(path) -> np.ndarray:
    return pq.read_table(path).column("logit").to_numpy()


@pytest.fixture(scope="session")
def movielens_run(tmp_path_factory):
    """DeepFM on a copy of the first 5,000 MovieLens rows, vocabulary mapping, 1 epoch.
    Returns (tmp dir, run dir, training file, raw rows to score)."""
    tmp = tmp_path_factory.mktemp("movielens")
    lines = MOVIELENS.read_text().splitlines()
    train = tmp / "ratings.csv"
    train.write_text("\n".join(lines[:5001]) + "\n")
    rows = tmp / "rows.csv"  # 400 rows of the training file and 400 it never had
    rows.write_text("\n".join([lines[0], *lines[4601:5001], *lines[9001:9401]]) + "\n")
    run = tmp / "run"
    cli(
        ["train", "--config", ROOT / "configs/movielens_deepfm.yaml", "--run-dir", run, *ONE_RANK]
        + ["train.epochs=1", f"data.raw_path={train}"],
        tmp,
    )
    return tmp, run, train, rows


def write_schema_data(tmp, n=1500, seed=0):
    """A schema-format dataset whose raw columns already look like converted ones (label,
    float dense d1 d2, small integer categories c1 c2), as CSV and as Parquet, same rows."""
    rng = np.random.default_rng(seed)
    d1 = np.round(rng.exponential(20.0, n), 3)
    d2 = np.round(rng.exponential(3.0, n), 3)
    c1 = rng.integers(0, 40, n)
    c2 = rng.integers(0, 12, n)
    label = ((c1 % 3 == 0) ^ (rng.random(n) < 0.2)).astype(np.int64)
    table = pa.table({"label": label, "d1": d1, "d2": d2, "c1": c1, "c2": c2})
    pq.write_table(table, tmp / "data.parquet")
    rows = ["label,d1,d2,c1,c2"] + [
        f"{a},{repr(float(b))},{repr(float(c))},{d},{e}" for a, b, c, d, e in zip(label, d1, d2, c1, c2)
    ]
    (tmp / "data.csv").write_text("\n".join(rows) + "\n")
    config = {
        "data": {
            "format": "schema",
            "raw_path": str(tmp / "data.parquet"),
            "schema": {"label": "label", "dense": ["d1", "d2"], "categorical": ["c1", "c2"]},
            "num_embeddings": 50,
            "split": [0.8, 0.1, 0.1],
        },
        "model": {"name": "deepfm", "embedding_dim": 8, "deep_layer_sizes": [16]},
        "train": {"batch_size": 64, "epochs": 1, "seed": 0},
        "distributed": {"nproc_per_node": 1},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp / "config.yaml"


@pytest.fixture(scope="session")
def schema_run(tmp_path_factory):
    """DeepFM trained on a raw schema-format Parquet file (hash mapping, log1p dense).
    Returns (tmp dir, run dir)."""
    tmp = tmp_path_factory.mktemp("schema")
    config = write_schema_data(tmp)
    run = tmp / "run"
    cli(["train", "--config", config, "--run-dir", run, *ONE_RANK], tmp)
    return tmp, run


@pytest.fixture(scope="session")
def criteo_run(tmp_path_factory):
    """The quickstart's DLRM on 2,000 Criteo rows, 1 rank, 10 steps. Returns (tmp dir, run dir)."""
    tmp = tmp_path_factory.mktemp("criteo")
    run = tmp / "run"
    cli(
        ["train", "--config", QUICKSTART, "--run-dir", run, *ONE_RANK]
        + ["data.num_rows=2000", "train.max_steps=10", "train.batch_size=64"],
        tmp,
    )
    return tmp, run


def converted_test_split(tmp, prefix):
    """The test split of the training conversion (``prefix``: criteo, schema, ...) under
    ``tmp/cache`` (scoring conversions put every row in train)."""
    found = [
        m.parent / "test.parquet"
        for m in (tmp / "cache").glob(f"{prefix}-*/manifest.json")
        if json.loads(m.read_text())["rows"]["test"] > 0
    ]
    assert len(found) == 1, found
    return found[0]


HTTP_LINES = CRITEO_SAMPLE.read_text().splitlines()[5000:5050]  # 50 rows the tiny run never trained on


@pytest.fixture(scope="session")
def export_dir(criteo_run):
    tmp, run = criteo_run
    out = tmp / "http_export"
    if not out.exists():
        cli(["export", run, "--out", out], tmp)
    return out


@pytest.fixture(scope="session")
def predicted(export_dir, tmp_path_factory):
    """``recsys-dist predict`` on the 50 rows as a raw file: (logit, probability) float32 [50]."""
    tmp = tmp_path_factory.mktemp("http_predict")
    (tmp / "rows.txt").write_text("\n".join(HTTP_LINES) + "\n")
    cli(["predict", export_dir, "--data", tmp / "rows.txt", "--out", tmp / "p.parquet"], tmp)
    t = predictions(tmp / "p.parquet")
    return t.column("logit").to_numpy(), t.column("probability").to_numpy()
