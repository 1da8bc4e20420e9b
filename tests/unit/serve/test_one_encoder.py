"""One encoder (``recsys_dist.data.encode``): the training loader, ``predict`` and ``POST /score``
(its in-memory route and its file route) turn the same raw rows into the same model batches,
through the same two steps: the conversion's ``Transform`` (raw -> converted columns) and the
loader's ``BatchLayout`` (converted columns -> CTRBatch). Per format: a CTR schema (dense,
categorical, multi-hot), criteo_tsv, and a history + sequence schema (MovieLens)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from recsys_dist.data.convert.passes import Transform
from recsys_dist.data.formats.criteo import COLUMNS as CRITEO_COLUMNS
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.loader.batch import BatchLayout
from recsys_dist.data.record import Preprocessing
from recsys_dist.data.resolve import prepare_from_config
from recsys_dist.serve.export import LoadedModel, score
from recsys_dist.serve.inmemory import InMemoryScorer
from recsys_dist.serve.request_rows import score_rows
from recsys_dist.train.job import load_job
from tests.conftest import CRITEO_SAMPLE, ROOT

MOVIELENS = ROOT / "datasets" / "movielens" / "ratings_genres_first20000_by_time.csv"


class Recorder(torch.nn.Module):
    """Stands in for the model: keeps every batch it is given, answers a logit per row."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = []

    def forward(self, batch):
        self.batches.append(batch)
        n = batch.dense_features.shape[0]
        return None, (None, torch.zeros(n), batch.labels, batch.weights)


def rows_of(batches, keys) -> dict:
    """The real rows (weight > 0) of ``batches``, per row: dense values, each key's ids, label."""
    dense, ids, labels = [], {k: [] for k in keys}, []
    for b in batches:
        keep = (b.weights > 0).numpy()
        dense.append(b.dense_features.numpy()[keep])
        labels.append(b.labels.numpy()[keep])
        kjt = b.sparse_features
        assert kjt.keys() == keys and kjt.values().dtype == torch.int64
        for k in keys:
            lists = kjt[k].to_dense()
            ids[k] += [lst.tolist() for lst, kept in zip(lists, keep) if kept]
    return {"dense": np.concatenate(dense), "ids": ids, "label": np.concatenate(labels)}


@pytest.fixture
def calls(monkeypatch):
    """Per path, how often it ran the encoder's two steps."""
    seen = {"transform": 0, "columns": 0, "cut": 0}

    def spy(cls, name, key):
        real = getattr(cls, name)

        def wrapped(self, *a, **k):
            seen[key] += 1
            return real(self, *a, **k)

        monkeypatch.setattr(cls, name, wrapped)

    spy(Transform, "apply", "transform")
    spy(BatchLayout, "columns", "columns")
    spy(BatchLayout, "cut", "cut")

    def took():
        out = dict(seen)
        seen.update(transform=0, columns=0, cut=0)
        return out

    return took


def three_paths(tmp_path, config, raw_text, objects, calls, name="rows.csv"):
    """Each path's rows of the same raw rows: training (the conversion, then the Trainer's
    loader), predict (``serve.export.score`` of the raw file), ``POST /score`` in memory and by
    file. Checks each ran both of the encoder's steps."""
    raw = tmp_path / name
    raw.write_text(raw_text)
    config["data"].update(raw_path=str(raw), split=[1.0, 0.0, 0.0], cache_dir=str(tmp_path / "cache"))
    job = load_job(json.loads(json.dumps(config)), "test config")
    f = job.features
    got, used = {}, {}

    prepared = prepare_from_config(job.data, fmt=job.fmt)  # as make_loaders converts for training
    loader = ParquetBatchLoader(
        prepared.paths("train"),
        16,
        0,
        1,
        f.dense_names,
        f.keys,
        num_embeddings=f.id_bounds,
        label_columns=f.label_columns,
    )
    got["train"], used["train"] = rows_of(list(loader), f.keys), calls()

    prep = Preprocessing.describe(job.data, job.fmt, job.table_sizes)
    model = Recorder()
    own_cache = dataclasses.replace(job, data=job.data.model_copy(update={"cache_dir": str(tmp_path / "c2")}))
    score(own_cache, model, raw, batch_size=16, preprocessing=prep)  # converted again: not training's entry
    got["predict"], used["predict"] = rows_of(model.batches, f.keys), calls()

    loaded = LoadedModel(job, Recorder(), "test", prep)
    scorer = InMemoryScorer(loaded)
    scorer(objects)
    got["serve"], used["serve"] = rows_of(loaded.model.batches, f.keys), calls()

    loaded.model.batches.clear()
    score_rows(loaded, objects)
    got["serve_file"], used["serve_file"] = rows_of(loaded.model.batches, f.keys), calls()

    for path, n in used.items():
        assert n["transform"] > 0 and n["columns"] > 0 and n["cut"] > 0, (path, n)
    want = got["train"]
    assert len(want["dense"]) == len(objects)
    for path, rows in got.items():
        np.testing.assert_array_equal(rows["dense"], want["dense"], err_msg=path)
        assert rows["ids"] == want["ids"], path
        if path == "predict":  # a labelled file: the labels too
            np.testing.assert_array_equal(rows["label"], want["label"])
    return got


def test_ctr_schema(tmp_path, calls):
    rng = np.random.default_rng(0)
    lines, objects = ["y,d1,d2,c1,c2,m"], []
    for i in range(40):
        d1 = "" if i % 7 == 3 else str(round(float(rng.exponential(5.0)), 3))
        d2 = str(int(rng.integers(-3, 50)))
        c1, c2 = f"u{rng.integers(12)}", "" if i % 5 == 1 else str(int(rng.integers(0, 30)))
        m = "|".join(f"g{g}" for g in rng.choice(8, int(rng.integers(0, 4)), replace=False))
        lines.append(f"{i % 2},{d1},{d2},{c1},{c2},{m}")
        objects.append({"d1": d1 or None, "d2": int(d2), "c1": c1, "c2": c2 or None, "m": m.split("|") if m else []})
    config = {
        "data": {
            "format": "schema",
            "schema": {
                "label": "y",
                "dense": ["d1", "d2"],
                "categorical": ["c1", "c2"],
                "multi_hot": ["m"],
                "separator": "|",
            },
            "num_embeddings": 97,
        },
        "model": {"name": "deepfm", "embedding_dim": 8, "deep_layer_sizes": [8]},
    }
    got = three_paths(tmp_path, config, "\n".join(lines) + "\n", objects, calls)
    assert any(len(ids) > 1 for ids in got["serve"]["ids"]["m"])  # multi-hot bags of several ids


def test_criteo(tmp_path, calls):
    lines = CRITEO_SAMPLE.read_text().splitlines()[100:140]
    objects = []
    for line in lines:
        fields = line.split("\t")
        objects.append({c: int(v) if c[0] == "I" else v for c, v in zip(CRITEO_COLUMNS[1:], fields[1:]) if v != ""})
    config = {"data": {"format": "criteo_tsv", "num_embeddings": 1000}, "model": {"name": "dlrm", "embedding_dim": 16}}
    got = three_paths(tmp_path, config, "\n".join(lines) + "\n", objects, calls, name="rows.txt")
    assert len({tuple(r) for r in got["serve"]["dense"]}) > 10


def test_history_and_sequence(tmp_path, calls):
    text = MOVIELENS.read_text().splitlines()[:61]
    header = text[0].split(",")
    objects = [dict(zip(header, line.split(","))) for line in text[1:]]
    for o in objects:
        del o["rating"]  # the label: a request need not send it
        o["genres"] = o["genres"].split("|")
    config = {
        "data": {
            "format": "schema",
            "schema": {
                "label": "rating",
                "label_threshold": 4.0,
                "categorical": ["userId", "movieId"],
                "sequence": {"genres": {"max_length": 3, "separator": "|"}},
                "history": {
                    "name": "history",
                    "user": "userId",
                    "item": "movieId",
                    "time": "timestamp",
                    "max_length": 5,
                },
            },
            "num_embeddings": 500,
        },
        "model": {
            "name": "din",
            "target_feature": "movieId",
            "embedding_dim": 8,
            "deep_layer_sizes": [8],
            "attention_sizes": [8],
        },
    }
    got = three_paths(tmp_path, config, "\n".join(text) + "\n", objects, calls)
    histories = got["serve"]["ids"]["history"]
    assert histories[0] == [] and max(map(len, histories)) == 5  # the first row has none; later ones are cut to 5
