import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.criteo import CRITEO
from recsys_dist.data.splits import Split
from recsys_dist.errors import DataError
from tests.conftest import ROOT, base_row


@pytest.mark.parametrize("mapping", ["hash", "vocabulary"])
def test_several_training_files_convert_in_worker_processes(tmp_path, cache_dir, mapping):
    """split.by files with three training files (one worker process each) gives, file by file
    in the order given, the rows of converting their concatenation; errors name the file."""
    import json

    lines = (ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt").read_text().splitlines(True)
    parts = [lines[:1500], lines[1500:2500], lines[2500:4000]]
    days = []
    for i, p in enumerate(parts):
        days.append(tmp_path / f"day_{i}.txt")
        days[-1].write_text("".join(p))
    whole, val, test = tmp_path / "whole.txt", tmp_path / "val.txt", tmp_path / "test.txt"
    whole.write_text("".join(lines[:4000]))
    val.write_text("".join(lines[4000:4500]))
    test.write_text("".join(lines[4500:5000]))
    split = Split(by="files", validation_path=str(val), test_path=str(test))
    many = prepare(ConversionSpec(CRITEO, [str(d) for d in days], 1000, split, mapping=mapping))
    one = prepare(ConversionSpec(CRITEO, str(whole), 1000, split, mapping=mapping))
    assert [p.name for p in many.files["train"]] == [
        "train-00000.parquet",
        "train-00001.parquet",
        "train-00002.parquet",
    ]
    assert many.rows == one.rows == {"train": 4000, "validation": 500, "test": 500}
    got = pa.concat_tables([pq.read_table(p) for p in many.files["train"]])
    assert got.equals(pq.read_table(one.files["train"]))
    for s in ("validation", "test"):
        assert pq.read_table(many.files[s]).equals(pq.read_table(one.files[s]))
    m1, m2 = (json.loads((p.directory / "manifest.json").read_text()) for p in (many, one))
    assert m1["files"]["train"] == ["train-00000.parquet", "train-00001.parquet", "train-00002.parquet"]
    for name, v in m2["dense_stats_train"].items():
        assert m1["dense_stats_train"][name] == pytest.approx(v, rel=1e-9)
    assert m1["num_embeddings"] == m2["num_embeddings"]
    # The workers' counts of the training values merge into those of one conversion (issue 40 item 9).
    assert m1["categorical_mapping"]["coverage"] == m2["categorical_mapping"]["coverage"]
    assert m2["categorical_mapping"]["coverage"]["C3"]["train_values"] > 0
    assert many.paths("train") == [str(p) for p in many.files["train"]]

    bad = lines[1500:2500]
    bad[9] = bad[9].replace("\t", "\tabc\t", 1).replace("\tabc\t", "\t", 0)  # an extra field on line 10
    days[1].write_text("".join(bad))
    with pytest.raises(DataError, match=r"day_1.txt, line 10: expected 40 fields, got 41"):
        prepare(ConversionSpec(CRITEO, [str(d) for d in days], 1000, split, mapping=mapping))
    assert not list(cache_dir.rglob("*.tmp"))  # nothing half-written is left
    m = json.loads(
        (
            prepare(
                ConversionSpec(CRITEO, [str(d) for d in days], 1000, split, mapping=mapping, on_bad_row="skip")
            ).directory
            / "manifest.json"
        ).read_text()
    )
    assert (m["rows"]["train"], m["rows_skipped"]) == (3999, 1)
    assert m["skipped_examples"][0]["file"] == "day_1.txt" and m["skipped_examples"][0]["line"] == 10


def test_a_training_file_listed_twice_is_warned_about(tmp_path, cache_dir, capsys):
    for name in ("d.txt", "v.txt", "t.txt"):
        (tmp_path / name).write_text(base_row() + "\n")
    split = Split(by="files", validation_path=str(tmp_path / "v.txt"), test_path=str(tmp_path / "t.txt"))
    p = prepare(ConversionSpec(CRITEO, [str(tmp_path / "d.txt"), str(tmp_path / "d.txt")], 100, split))
    assert p.rows["train"] == 2
    assert "d.txt more than once" in capsys.readouterr().err
