"""An export (and a checkpoint once scored) carries everything scoring needs: the training
data may change, move or disappear afterwards without changing a single prediction."""

import json
import shutil

import numpy as np
import pytest

from tests.e2e.serve.conftest import cli, converted_test_split, logits

pytestmark = pytest.mark.slow


def test_predictions_survive_changes_to_the_training_file(movielens_run, tmp_path):
    tmp, run, train, rows = movielens_run
    # The trainer pins the record beside every checkpoint it writes, before anything scores it.
    ckpt = next((run / "checkpoints").glob("step_*"))
    assert (ckpt / "preprocessing.json").is_file() and (ckpt / "vocabulary.parquet").is_file()
    export = tmp_path / "export"
    r = cli(["export", run, "--out", export], tmp)
    # The weights are as readable as the export's other files (safetensors wrote them 0600).
    assert (export / "model.safetensors").stat().st_mode & 0o777 == (export / "config.yaml").stat().st_mode & 0o777

    def scores(model, name):
        cli(["predict", model, "--data", rows, "--out", tmp_path / f"{name}.parquet"], tmp)
        return logits(tmp_path / f"{name}.parquet")

    before = {"export": scores(export, "e0"), "run": scores(run, "r0")}
    assert len(before["export"]) == 800 and np.array_equal(before["export"], before["run"])

    original = train.read_bytes()
    try:
        # Appended rows: a vocabulary rebuilt from the file now would rank keys differently.
        extra = (tmp / "rows.csv").read_text().splitlines()[401:]
        with open(train, "a") as f:
            f.write("\n".join(extra * 3) + "\n")
        assert np.array_equal(scores(export, "e1"), before["export"])
        assert np.array_equal(scores(run, "r1"), before["run"])
        train.unlink()  # deleted (or moved)
        assert np.array_equal(scores(export, "e2"), before["export"])
        assert np.array_equal(scores(run, "r2"), before["run"])
        moved = tmp_path / "moved_export"
        shutil.copytree(export, moved)
        assert np.array_equal(scores(moved, "e3"), before["export"])
    finally:
        train.write_bytes(original)

    # What the export carries, and the record pinned beside the checkpoint.
    assert "vocabulary.parquet" in r.stdout
    record = json.loads((export / "preprocessing.json").read_text())
    assert record["categorical_mapping"]["kind"] == "vocabulary"
    ckpt = next((run / "checkpoints").glob("step_*"))
    assert record["num_embeddings"] == json.loads((ckpt / "meta.json").read_text())["num_embeddings"]
    assert {"recsys_dist", "torch", "torchrec", "fbgemm-gpu", "pyarrow"} <= set(record["written_by"])
    assert (ckpt / "preprocessing.json").is_file() and (ckpt / "vocabulary.parquet").is_file()


def test_a_checkpoint_whose_training_data_changed_is_refused_not_rebuilt(movielens_run, tmp_path):
    tmp, run, train, rows = movielens_run
    ckpt = next((run / "checkpoints").glob("step_*"))
    copy = tmp_path / "step_copy"
    shutil.copytree(ckpt, copy)
    for name in ("preprocessing.json", "vocabulary.parquet"):  # as the trainer writes it: nothing pinned
        (copy / name).unlink(missing_ok=True)
    original = train.read_bytes()
    try:
        with open(train, "a") as f:
            f.write(rows.read_text().splitlines()[-1] + "\n")
        for cmd in (
            ["predict", copy, "--data", rows, "--out", tmp_path / "p.parquet"],
            ["export", copy, "--out", tmp_path / "x"],
        ):
            r = cli(cmd, tmp, check=False)
            assert r.returncode == 1, r.stderr[-2000:]
            assert f"checkpoint {copy}" in r.stderr and "holds no copy of it" in r.stderr
            assert "no conversion of" in r.stderr and "recsys-dist export" in r.stderr
        assert not (tmp_path / "x" / "model.safetensors").exists()
        train.unlink()
        r = cli(["predict", copy, "--data", rows, "--out", tmp_path / "p.parquet"], tmp, check=False)
        assert r.returncode == 1 and f"the training data {train} is gone" in r.stderr
    finally:
        train.write_bytes(original)
    # Restored as it was (same bytes, so a new mtime: another cache key) the vocabulary is
    # still not rebuilt silently: the conversion it would find is newer than the checkpoint.
    r = cli(["export", copy, "--out", tmp_path / "x"], tmp, check=False)
    assert r.returncode == 1 and "holds no copy of it" in r.stderr


def test_a_damaged_export_vocabulary_is_refused(movielens_run, tmp_path):
    import pyarrow.parquet as pq

    tmp, run, _, rows = movielens_run
    export = tmp_path / "export"
    cli(["export", run, "--out", export], tmp)
    vocab = pq.read_table(export / "vocabulary.parquet")
    pq.write_table(vocab.slice(1), export / "vocabulary.parquet")
    r = cli(["predict", export, "--data", rows, "--out", tmp_path / "p.parquet"], tmp, check=False)
    assert r.returncode == 1 and "differs from the vocabulary" in r.stderr and "export the model again" in r.stderr


def test_an_export_without_its_preprocessing_record_is_refused(criteo_run, tmp_path):
    """recsys_dist 0.1.0 wrote exports without preprocessing.json; a hash-mapped one was then
    scored with a record made up from its config.yaml. Now such an export is refused (exit 1),
    naming it and the fix, hash mapping included; its run exports again and scores."""
    tmp, run = criteo_run
    export = tmp_path / "export"
    cli(["export", run, "--out", export], tmp)
    (export / "preprocessing.json").unlink()
    data = converted_test_split(tmp, "criteo")
    r = cli(["evaluate", export, "--data", data], tmp, check=False)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"export {export} holds no preprocessing.json: it was written by an older recsys_dist" in r.stderr
    assert "Export its run or checkpoint again with `recsys-dist export`" in r.stderr
    cli(["export", run, "--out", export], tmp)
    assert cli(["evaluate", export, "--data", data], tmp).returncode == 0
