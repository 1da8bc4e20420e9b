"""The pieces scoring is built from, without training: converted-split recognition, the
preprocessing record, and a vocabulary-mapped model that is never given a vocabulary."""

import json

import numpy as np
import pytest

from recsys_dist.data import mapping as mp
from recsys_dist.data.convert import CACHE_FORMAT
from recsys_dist.data.resolve import data_format
from recsys_dist.errors import DataError
from recsys_dist.serve.score_inputs import Preprocessing, converted_manifest, prepare_for_scoring
from tests.conftest import ROOT

MANIFEST = {
    "cache_format": CACHE_FORMAT,
    "format": "schema",
    "rows": {"train": 1, "validation": 0, "test": 0},
    "num_embeddings": [10],
}


@pytest.mark.parametrize(
    "files, listed",
    [
        ({"train": ["train.parquet"], "validation": ["validation.parquet"], "test": ["data.parquet"]}, True),
        ({"train": ["train-00000.parquet", "train-00001.parquet"], "test": ["test.parquet"]}, False),
        ({"train": [{"name": "data.parquet", "size": 1, "checksum": "x"}]}, True),
    ],
)
def test_a_converted_split_is_the_file_its_manifest_lists(tmp_path, files, listed):
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    assert converted_manifest(tmp_path / "data.parquet") is None  # no manifest: raw data
    (tmp_path / "manifest.json").write_text(json.dumps({**MANIFEST, "files": files}))
    assert (converted_manifest(tmp_path / "data.parquet") is not None) == listed
    # A manifest.json of something else beside raw data does not make it converted.
    (tmp_path / "manifest.json").write_text(json.dumps({"files": files or {}, "owner": "someone"}))
    assert converted_manifest(tmp_path / "data.parquet") is None


@pytest.mark.parametrize("found", [None, 1, 3])
def test_a_converted_split_of_another_cache_format_is_refused(tmp_path, found):
    """recsys_dist 0.1.0 wrote manifests without cache_format (and maybe without "files", when
    the split files were train / validation / test.parquet); such a split is refused, naming the
    directory, the format found and expected and the fix, instead of being read as it was."""
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    old = {k: v for k, v in MANIFEST.items() if k != "cache_format"} | ({"cache_format": found} if found else {})
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    who = "a newer" if found == 3 else "an older"
    with pytest.raises(DataError) as e:
        converted_manifest(tmp_path / "train.parquet")
    assert str(e.value) == (
        f"{tmp_path}: this conversion was written by {who} recsys_dist (cache format {found or 1}; this one reads "
        f"format {CACHE_FORMAT} only): re-run the conversion: delete {tmp_path}"
    )


def _movielens():
    from recsys_dist.config.loader import load_config

    return load_config(ROOT / "configs" / "movielens_deepfm.yaml")


def test_record_round_trip_and_a_changed_vocabulary_is_refused(tmp_path):
    cfg = _movielens()
    conversion = tmp_path / "conversion"
    conversion.mkdir()
    vocabs = [mp.Vocabulary(np.array([5, 9], np.uint64), np.array([3, 2]), np.array([1, 4])) for _ in range(3)]
    mp.save_vocabularies(conversion / "vocabulary.parquet", ["userId", "movieId", "genres"], vocabs)
    manifest = {"transforms": {"dense": "x"}, "source": "ratings.csv", "rows": {"train": 3}}
    (conversion / "manifest.json").write_text(json.dumps(manifest))
    record = Preprocessing.describe(cfg.data, data_format(cfg.data), [4, 4, 4], conversion, manifest)
    assert record.vocabulary == conversion / "vocabulary.parquet"
    out = tmp_path / "export"
    out.mkdir()
    record.save(out)
    loaded = Preprocessing.load(out)
    assert loaded.record == json.loads(json.dumps(record.record)) and loaded.vocabulary == out / "vocabulary.parquet"
    assert loaded.record["categorical_mapping"]["kind"] == "vocabulary" and loaded.record["written_by"]["torch"]
    vocabs[1].ids[:] = [2, 3]  # one id moved
    mp.save_vocabularies(out / "vocabulary.parquet", ["userId", "movieId", "genres"], vocabs)
    with pytest.raises(DataError, match="differs from the vocabulary"):
        Preprocessing.load(out)
    (out / "vocabulary.parquet").unlink()
    with pytest.raises(DataError, match="vocabulary.parquet: missing"):
        Preprocessing.load(out)


def test_a_vocabulary_model_is_never_scored_by_rebuilding_its_vocabulary(tmp_path):
    rows = tmp_path / "rows.csv"
    rows.write_text("userId,movieId,rating,timestamp,genres\n1,31,2.5,1,Drama\n")
    with pytest.raises(DataError, match="maps categories through its training vocabulary, and none was given"):
        prepare_for_scoring(_movielens().data, rows)


def test_a_cached_manifest_that_is_not_an_object_is_named_for_a_checkpoint(tmp_path, monkeypatch):
    """A vocabulary checkpoint with nothing pinned looks up its training conversion: a
    manifest.json there that is JSON but not an object gave a bare AttributeError."""
    from recsys_dist.serve import score_inputs

    cfg = _movielens()
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "manifest.json").write_text("[1, 2]")
    monkeypatch.setattr(score_inputs, "training_conversion", lambda d: entry)
    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    meta = {"config": cfg.to_dict(), "num_embeddings": [10] * 4}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"entry/manifest.json is not a conversion's manifest \(a JSON object\)"):
        score_inputs.for_checkpoint(ckpt, meta)
