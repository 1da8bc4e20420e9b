"""What evaluate / predict accept: raw files of the model's format (Parquet included, labelled
or not), converted splits recognised by their manifest (never by the file name), and raw
columns carried into the predictions."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from tests.conftest import CRITEO_SAMPLE
from tests.e2e.serve.conftest import cli, converted_test_split, logits

pytestmark = pytest.mark.slow


def evaluate(model, data, tmp):
    return json.loads(cli(["evaluate", model, "--data", data], tmp).stdout.strip().splitlines()[-1])


def test_raw_schema_parquet_is_converted_like_the_same_rows_as_csv(schema_run, tmp_path):
    tmp, run = schema_run
    for model in (run, tmp_path / "export"):
        if model != run:
            cli(["export", run, "--out", model], tmp)
        by_file = {}
        for name in ("data.parquet", "data.csv"):
            out = tmp_path / f"{model.name}-{name}.parquet"
            cli(["predict", model, "--data", tmp / name, "--out", out], tmp)
            by_file[name] = logits(out)
        # The raw Parquet's columns look converted (label, floats, small ints); it is still
        # hashed and log1p-transformed like the CSV, never read as ids.
        assert len(by_file["data.csv"]) == 1500
        assert np.array_equal(by_file["data.parquet"], by_file["data.csv"])
        a, b = evaluate(model, tmp / "data.parquet", tmp), evaluate(model, tmp / "data.csv", tmp)
        assert a["logloss"] == b["logloss"] and a["num_examples"] == 1500


def test_converted_split_is_recognised_by_its_manifest(schema_run, tmp_path):
    tmp, run = schema_run
    test = converted_test_split(tmp, "schema")
    metrics = json.loads((run / "summary.json").read_text())["test"]
    got = evaluate(run, test, tmp)
    assert got["num_examples"] == 150 and got["logloss"] == pytest.approx(metrics["logloss"], abs=1e-6)
    # The same file without its manifest is raw data to the schema format: its columns
    # (label, d1, d2, c1, c2) are there, so it is hashed and transformed again, never taken as ids...
    alone = tmp_path / "test.parquet"
    shutil.copy(test, alone)
    r = cli(["evaluate", run, "--data", alone], tmp, check=False)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["logloss"] != got["logloss"]
    # ... and a split converted with other table sizes is refused, naming the difference.
    other = tmp_path / "other"
    shutil.copytree(test.parent, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["num_embeddings"] = [60, 60]
    (other / "manifest.json").write_text(json.dumps(manifest))
    r = cli(["evaluate", run, "--data", other / "test.parquet"], tmp, check=False)
    assert r.returncode == 1 and "converted with other settings" in r.stderr and "num_embeddings [60, 60]" in r.stderr


def test_criteo_parquet_without_manifest_is_refused(criteo_run, tmp_path):
    tmp, run = criteo_run
    test = converted_test_split(tmp, "criteo")
    assert evaluate(run, test, tmp)["num_examples"] == 200
    alone = tmp_path / "test.parquet"
    shutil.copy(test, alone)
    r = cli(["evaluate", run, "--data", alone], tmp, check=False)
    assert r.returncode == 1 and "not a converted split" in r.stderr and "criteo_tsv raw data is text" in r.stderr


def test_schema_rows_without_label_are_predicted_and_raw_columns_kept(schema_run, tmp_path):
    tmp, run = schema_run
    labelled = pq.read_table(tmp / "data.parquet")
    ids = pa.array([f"u{i:05d}" for i in range(labelled.num_rows)])
    unlabelled = labelled.drop_columns(["label"]).append_column("id", ids)
    pq.write_table(unlabelled, tmp_path / "serve.parquet")
    csv = (tmp / "data.csv").read_text().splitlines()
    (tmp_path / "serve.csv").write_text(
        "\n".join(["id," + csv[0].split(",", 1)[1]] + [f"u{i:05d},{x.split(',', 1)[1]}" for i, x in enumerate(csv[1:])])
        + "\n"
    )
    cli(["predict", run, "--data", tmp / "data.csv", "--out", tmp_path / "ref.parquet"], tmp)
    ref = pq.read_table(tmp_path / "ref.parquet")
    for name in ("serve.parquet", "serve.csv"):
        out = tmp_path / f"{name}.out.csv"
        cli(["predict", run, "--data", tmp_path / name, "--out", out, "--keep-columns", "id,c1"], tmp)
        t = pacsv.read_csv(out, convert_options=pacsv.ConvertOptions(column_types={"id": pa.string()}))
        assert t.column_names == ["row", "id", "c1", "label", "logit", "probability"]
        assert t.column("label").null_count == t.num_rows == 1500
        assert np.allclose(t.column("logit").to_numpy(), ref.column("logit").to_numpy(), rtol=0, atol=1e-6)
        assert t.column("id").to_pylist() == ids.to_pylist()
        assert t.column("c1").to_pylist() == labelled.column("c1").to_pylist()
    # Parquet output keeps the exact logits.
    cli(["predict", run, "--data", tmp_path / "serve.csv", "--out", tmp_path / "s.parquet"], tmp)
    assert np.array_equal(logits(tmp_path / "s.parquet"), ref.column("logit").to_numpy())
    r = cli(["evaluate", run, "--data", tmp_path / "serve.csv"], tmp, check=False)
    assert r.returncode == 1 and "no label column" in r.stderr and "recsys-dist predict" in r.stderr


def test_keep_columns_errors_name_the_column_and_the_fix(schema_run, criteo_run, tmp_path):
    tmp, run = schema_run
    r = cli(
        ["predict", run, "--data", tmp / "data.csv", "--out", tmp_path / "p.csv", "--keep-columns", "c1,user"],
        tmp,
        check=False,
    )
    assert (
        r.returncode == 1
        and "--keep-columns: user is not a column of" in r.stderr
        and "label, d1, d2, c1, c2" in r.stderr
    )
    r = cli(
        ["predict", run, "--data", tmp / "data.csv", "--out", tmp_path / "p.csv", "--keep-columns", "logit"],
        tmp,
        check=False,
    )
    assert r.returncode == 2 and "--keep-columns: logit is an output column already" in r.stderr
    test = converted_test_split(tmp, "schema")
    r = cli(["predict", run, "--data", test, "--out", tmp_path / "p.csv", "--keep-columns", "c1"], tmp, check=False)
    assert r.returncode == 1 and "is a converted split" in r.stderr and "Give the raw file" in r.stderr
    # Criteo: the raw columns by their names (label, I1..I13, C1..C26).
    ctmp, crun = criteo_run
    rows = tmp_path / "rows.txt"
    rows.write_text("\n".join(CRITEO_SAMPLE.read_text().splitlines()[:50]) + "\n")
    cli(["predict", crun, "--data", rows, "--out", tmp_path / "c.parquet", "--keep-columns", "C1,I2"], ctmp)
    t = pq.read_table(tmp_path / "c.parquet")
    assert t.column("C1").to_pylist() == [line.split("\t")[14] for line in rows.read_text().splitlines()]
