"""A model with hooks and a raw format, each in one file of the user's, named by import path in
YAML: they train through the public API with their checks and hooks applied, and the format's
model is served over HTTP (its own request side) with ``recsys-dist predict``'s scores."""

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

import recsys_dist
from recsys_dist.errors import ConfigError
from recsys_dist.serve.export import load
from recsys_dist.serve.http import ModelHolder, create_app, open_source
from recsys_dist.serve.inmemory import row_scorer
from recsys_dist.serve.request_rows import score_rows
from tests.cli import run_cli

ROOT = Path(__file__).resolve().parents[3]
FORMAT_DIR = ROOT / "examples" / "custom_format"

TOY_MODEL = textwrap.dedent(
    """
    import dataclasses
    from torch import nn
    from torchrec import EmbeddingBagCollection
    from recsys_dist import register_model
    from recsys_dist.data.spec import make_tables

    def only_dense_free(job):
        return [] if job.features.num_dense == 0 else [f"model.name: {job.model.name} reads no dense features"]

    def with_bias_table(spec):
        bias = make_tables(spec.sparse_names[:1], spec.num_embeddings[:1], spec.embedding_dim, prefix="b_")
        return dataclasses.replace(spec, first_order_tables=bias)

    class SumTower(nn.Module):
        def __init__(self, spec, hidden):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=spec.all_tables(), device=spec.embedding_device)
            self.out = nn.Linear(spec.embedding_dim * len(spec.all_tables()), 1, device=spec.device)
            self.names = [t.name for t in spec.all_tables()]

        def forward(self, dense, sparse):
            return self.out(self.ebc(sparse).values()).squeeze(-1)

    @register_model("sum_tower_toy", checks=[only_dense_free], on_features=with_bias_table)
    def sum_tower(spec, hidden: int = 8):
        return SumTower(spec, hidden)
    """
)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "toy_model.py").write_text(TOY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(FORMAT_DIR))
    yield tmp_path
    sys.modules.pop("toy_model", None)


def _config(tmp_path, model: str, data: dict) -> Path:
    import yaml

    cfg = {
        "data": data,
        "model": {"name": model, "embedding_dim": 8},
        "train": {"batch_size": 64, "epochs": 1, "max_steps": 10},
        "distributed": {"nproc_per_node": 1},
        "checkpoint": {"enabled": True},
    }
    path = tmp_path / f"{model.replace(':', '_')}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _jsonl(tmp_path) -> dict:
    sys.path.insert(0, str(FORMAT_DIR))
    import make_jsonl

    raw = make_jsonl.main(1000, tmp_path / "rows.jsonl")
    dense = [f"I{i}" for i in range(1, 14)]
    categorical = [f"C{i}" for i in range(1, 27)]
    return {
        "format": "jsonl_format:jsonl",
        "format_args": {"label": "label", "dense": dense, "categorical": categorical},
        "raw_path": str(raw),
        "split": [0.8, 0.1, 0.1],
        "num_embeddings": 1000,
    }


def test_a_format_in_one_file_trains_from_yaml_and_is_served(user_dir, tmp_path):
    data = _jsonl(tmp_path)
    cfg = recsys_dist.load_config(_config(tmp_path, "dlrm", data), ["model.dense_arch_layer_sizes=[16,8]"])
    job = recsys_dist.resolve_job(cfg)
    assert job.fmt.name == "jsonl" and len(job.features.dense_names) == 13 and len(job.features.keys) == 26
    with recsys_dist.Trainer(cfg, tmp_path / "run") as trainer:
        summary = trainer.fit()
    manifest = json.loads((Path(trainer.job.prepared.directory) / "manifest.json").read_text())
    assert manifest["format"] == "jsonl" and manifest["rows"] == {"train": 800, "validation": 100, "test": 100}
    assert 0.5 < summary["test"]["auc"] < 1.0
    # an argument the factory does not take is a config error naming data.format_args
    with pytest.raises(ConfigError, match="data.format_args: .*takes no argument 'delimiter'"):
        recsys_dist.load_config(
            _config(tmp_path, "dlrm", {**data, "format_args": {**data["format_args"], "delimiter": "|"}})
        )
    _served_as_predicted(tmp_path / "run", tmp_path)


def _served_as_predicted(run: Path, tmp_path: Path) -> None:
    """Export the JSON-lines model, predict 40 rows it never trained on, and POST the same rows
    (objects with and without their label) to /score: the same logits, in memory and by file."""
    import make_jsonl

    env = {"PYTHONPATH": os.pathsep.join([str(FORMAT_DIR), str(ROOT)])}
    lines = make_jsonl.main(1040, tmp_path / "all.jsonl").read_text().splitlines()[1000:]
    (tmp_path / "unseen.jsonl").write_text("\n".join(lines) + "\n")
    for args in (
        ["export", run, "--out", tmp_path / "export"],
        ["predict", tmp_path / "export", "--data", tmp_path / "unseen.jsonl", "--out", tmp_path / "p.parquet"],
    ):
        r = run_cli(args, tmp_path, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    predicted = pq.read_table(tmp_path / "p.parquet")
    want, prob = predicted.column("logit").to_numpy(), predicted.column("probability").to_numpy()
    rows = [json.loads(line) for line in lines]
    unlabelled = [{k: v for k, v in r.items() if k != "label"} for r in rows]
    loaded = load(tmp_path / "export")
    assert row_scorer(loaded).kind == "in-memory"
    np.testing.assert_allclose(score_rows(loaded, rows)["logits"], want, rtol=0, atol=1e-6)  # by file
    with TestClient(create_app(ModelHolder(open_source(tmp_path / "export"), 0))) as c:
        for body in (rows, unlabelled):
            got = c.post("/score", json={"rows": body})
            assert got.status_code == 200, got.text
            np.testing.assert_allclose(got.json()["logits"], want, rtol=0, atol=1e-6)
            np.testing.assert_allclose(got.json()["scores"], prob, rtol=0, atol=1e-6)
        bad = c.post("/score", json={"rows": [{**rows[0], "C3": ["a"]}]})
        assert bad.status_code == 400 and "rows[0], column C3: a list is not a value" in bad.json()["error"]
        bad = c.post("/score", json={"rows": lines[:2]})
        assert bad.status_code == 400 and "give each row as a JSON object" in bad.json()["error"]


def test_a_model_with_hooks_in_one_file_runs_from_yaml(user_dir, tmp_path):
    avazu = {
        "format": "avazu_csv",
        "raw_path": str(ROOT / "datasets" / "avazu" / "avazu_train_first8999.csv"),
        "split": [0.8, 0.1, 0.1],
        "num_embeddings": 1000,
    }
    cfg = recsys_dist.load_config(_config(tmp_path, "toy_model:sum_tower", avazu))
    job = recsys_dist.resolve_job(cfg)
    assert job.model_spec.on_features is not None  # the registered hooks, though named by import path
    assert [t.name for t in job.features.first_order_tables] == ["b_" + job.features.sparse_names[0]]
    with recsys_dist.Trainer(cfg, tmp_path / "run") as trainer:
        summary = trainer.fit()
    assert summary["steps"] == 10 and "b_" + job.features.sparse_names[0] in (tmp_path / "run" / "plan.txt").read_text()
    # its check runs: criteo has dense features, which this model refuses
    criteo = {"format": "criteo_tsv", "raw_path": str(ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt")}
    with pytest.raises(ConfigError, match="reads no dense features"):
        recsys_dist.Trainer(recsys_dist.load_config(_config(tmp_path, "toy_model:sum_tower", criteo)), tmp_path / "r2")
