import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import config_from_dict
from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.schema import SchemaFormat
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.mapping import hash_ids, text_keys
from recsys_dist.errors import DataError

SPEC = SchemaConfig(label="rating", label_threshold=4.0, dense=["age"], categorical=["user"], multi_hot=["tags"])
CSV = """user,rating,age,tags,ignored
u1,4.5,3,a|b|c|d|e,x
u2,2.0,,,y
u1,4.0,-7,b,z
u3,1,0,a||c,w
"""


def ids(values, n=1000):
    keys, present = text_keys(pa.array(values))
    out = hash_ids(keys, n)
    out[~present] = 0
    return out.tolist()


def test_csv_label_threshold_dense_categorical_and_multi_hot(tmp_path, cache_dir):
    raw = tmp_path / "r.csv"
    raw.write_text(CSV)
    p = prepare(ConversionSpec(SchemaFormat(SPEC), raw, 1000, split=(1.0, 0.0, 0.0)))
    t = pq.read_table(p.files["train"])
    assert t.schema.names == ["label", "age", "user", "tags"]
    assert t.schema.field("tags").type == pa.list_(pa.int64())
    assert t.column("label").to_pylist() == [1.0, 0.0, 1.0, 0.0]  # rating >= 4
    np.testing.assert_allclose(t.column("age").to_pylist(), np.log1p([3, 0, 0, 0]), rtol=1e-6)
    assert t.column("user").to_pylist() == ids(["u1", "u2", "u1", "u3"])
    a, b, c, d, e = ids(["a", "b", "c", "d", "e"])
    assert t.column("tags").to_pylist() == [[a, b, c, d, e], [], [b], [a, c]]  # empty elements dropped
    m = json.loads((p.directory / "manifest.json").read_text())
    assert m["format"] == "schema" and m["schema"]["tags"] == "list<item: int64>"


def test_multi_hot_bags_in_one_batch_and_mean_of_empty_bag_is_zero(tmp_path, cache_dir):
    """Issue 3, bad input 5: an empty list, lists of 1 and 5 in one batch; mean pooling of the
    empty bag gives zeros, not NaN."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    raw = tmp_path / "r.csv"
    raw.write_text(CSV)
    p = prepare(ConversionSpec(SchemaFormat(SPEC), raw, 50, split=(1.0, 0.0, 0.0)))
    batch = next(
        iter(ParquetBatchLoader(str(p.files["train"]), 4, 0, 1, ["age"], ["user", "tags"], num_embeddings=[50, 50]))
    )
    assert batch.sparse_features["tags"].lengths().tolist() == [5, 0, 1, 2]
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t_{n}", embedding_dim=4, num_embeddings=50, feature_names=[n], pooling=PoolingType.MEAN
            )
            for n in ("user", "tags")
        ]
    )
    pooled = ebc(batch.sparse_features)["tags"]
    assert torch.isfinite(pooled).all() and pooled[1].abs().sum() == 0 and pooled[0].abs().sum() > 0


def test_headerless_tsv_and_parquet_give_the_same_rows(tmp_path, cache_dir):
    spec = SchemaConfig(
        label="click",
        categorical=["item"],
        multi_hot=["tags"],
        dense=["n"],
        delimiter="\t",
        header=False,
        columns=["click", "item", "tags", "n"],
        dense_transform="none",
    )
    tsv = tmp_path / "r.tsv"
    tsv.write_text("1\t17\tx|y\t2.5\n0\t18\t\t-1\n")
    par = tmp_path / "r.parquet"
    pq.write_table(
        pa.table(
            {
                "click": pa.array([1, 0], pa.int8()),
                "item": pa.array([17, 18], pa.int64()),
                "tags": pa.array([["x", "y"], []]),
                "n": [2.5, -1.0],
            }
        ),
        par,
    )
    got = [
        pq.read_table(prepare(ConversionSpec(SchemaFormat(spec), f, 100, split=(1.0, 0.0, 0.0))).files["train"])
        for f in (tsv, par)
    ]
    assert got[0].equals(got[1])
    assert got[0].column("n").to_pylist() == [2.5, -1.0]  # dense_transform: none
    assert got[0].column("item").to_pylist() == ids(["17", "18"], 100)


def test_columns_need_an_explicit_header_for_text_files_only():
    """columns with the default header: true read a headerless file's first row as its header
    (one row lost, silently): a text file must now say header: true or false; a Parquet file,
    whose columns its schema names and which has no header line, needs neither."""

    def data(raw, **schema):
        s = {"label": "click", "categorical": ["item"], "columns": ["click", "item"], **schema}
        return {"data": {"format": "schema", "raw_path": raw, "schema": s}, "model": {"name": "deepfm"}}

    several = data(["r.parquet", "r.csv"])
    several["data"]["split"] = {"by": "files", "validation_path": "v.parquet", "test_path": "t.parquet"}
    for tree in (data("r.csv"), data("r.tsv"), several):
        with pytest.raises(ConfigError, match=r"data.schema.header: must be given with data.schema.columns: false"):
            config_from_dict(tree)
    assert not config_from_dict(data("r.csv", header=False)).data.schema_.header
    assert config_from_dict(data("r.csv", header=True)).data.schema_.header
    config_from_dict(data("r.parquet"))
    config_from_dict(data("r.data", file_type="parquet"))
    with pytest.raises(ConfigError, match=r"data.schema.header: must be given"):
        config_from_dict(data("r.parquet", file_type="csv"))


def test_bad_values_name_file_line_and_column(tmp_path, cache_dir):
    raw = tmp_path / "r.csv"
    raw.write_text(CSV.replace("u2,2.0,,", "u2,2.0,abc,"))
    with pytest.raises(DataError, match=r"r.csv, column age, line 3: 'abc' is not a number"):
        prepare(ConversionSpec(SchemaFormat(SPEC), raw, 100))
    raw.write_text(CSV.replace("u3,1,", "u3,,"))
    with pytest.raises(DataError, match=r"r.csv, line 5, column rating: the label is missing \(empty\)"):
        prepare(ConversionSpec(SchemaFormat(SPEC), raw, 100))
    no_threshold = SchemaConfig(label="rating", categorical=["user"])
    with pytest.raises(DataError, match=r"line 2, column rating: '4.5' is not 0 or 1"):
        prepare(ConversionSpec(SchemaFormat(no_threshold), tmp_path / "r.csv", 100))
    raw.write_text("rating,user,age\n1,a,1\n2,b,2\n0,c,x\n0,d,\n")
    p = prepare(
        ConversionSpec(
            SchemaFormat(SchemaConfig(label="rating", categorical=["user"], dense=["age"])),
            raw,
            100,
            split=(1.0, 0.0, 0.0),
            on_bad_row="skip",
        )
    )
    m = json.loads((p.directory / "manifest.json").read_text())
    assert m["rows_written"] == 2 and m["rows_skipped"] == 2  # rows read = written + skipped
    assert "column rating: '2'" in m["skipped_examples"][0]["reason"]
    assert "column age: 'x'" in m["skipped_examples"][1]["reason"]
    missing = SchemaConfig(label="rating", categorical=["user", "movie"])
    with pytest.raises(DataError, match=r"r.csv: columns \['movie'\] named in data.schema are not in the file"):
        prepare(ConversionSpec(SchemaFormat(missing), raw, 100))


def test_schema_config_is_checked():
    base = {"raw_path": None, "format": "schema"}
    with pytest.raises(ConfigError, match="data.schema: required with format: schema"):
        config_from_dict({"data": base})
    with pytest.raises(ConfigError, match="'rating' is also a feature column"):
        config_from_dict({"data": {**base, "schema": {"label": "rating", "categorical": ["rating"]}}})
    with pytest.raises(ConfigError, match="data.schema.bogus: unknown key"):
        config_from_dict({"data": {**base, "schema": {"label": "y", "categorical": ["a"], "bogus": 1}}})
    with pytest.raises(ConfigError, match="only used with format: schema"):
        config_from_dict({"data": {"schema": {"label": "y", "categorical": ["a"]}}})
    cfg = config_from_dict(
        {
            "data": {**base, "schema": {"label": "y", "categorical": ["a"], "multi_hot": ["g"]}},
            "model": {"name": "deepfm"},
        }
    )
    from recsys_dist.config.job import resolve_job

    features = resolve_job(cfg).features
    assert (features.dense_names, features.keys) == ([], ["a", "g"])
    assert config_from_dict(cfg.to_dict()).data.schema == cfg.data.schema  # the saved config reloads


CRITEO_I = [f"I{i}" for i in range(1, 14)]
CRITEO_C = [f"C{i}" for i in range(1, 27)]


@pytest.mark.parametrize("mapping", ["hash", "vocabulary"])
def test_kaggle_csv_with_hex_categorical_gives_the_criteo_ids(tmp_path, cache_dir, mapping):
    """The same 200 Criteo rows as Kaggle's CSV (Id, Label, I1.., C1..; a header; CRLF) through
    format: schema gave other ids than the TSV (a hash of the text, not the hex value)."""
    from recsys_dist.data.convert import ConversionSpec, prepare
    from recsys_dist.data.formats.criteo import CRITEO
    from tests.conftest import CRITEO_SAMPLE

    lines = CRITEO_SAMPLE.read_text().splitlines()[:200]
    tsv = tmp_path / "r.txt"
    tsv.write_text("\n".join(lines) + "\n")
    csv = tmp_path / "r.csv"
    header = ",".join(["Id", "Label", *CRITEO_I, *CRITEO_C])
    csv.write_bytes(
        (
            header + "\r\n" + "".join(f"{10000000 + k},{line.replace(chr(9), ',')}\r\n" for k, line in enumerate(lines))
        ).encode()
    )
    spec = SchemaConfig(label="Label", dense=CRITEO_I, categorical=CRITEO_C, hex_categorical=CRITEO_C)
    a = prepare(ConversionSpec(CRITEO, tsv, 1000, mapping=mapping))
    b = prepare(ConversionSpec(SchemaFormat(spec), csv, 1000, mapping=mapping))
    assert a.rows == b.rows == {"train": 160, "validation": 20, "test": 20}
    assert a.num_embeddings == b.num_embeddings
    for s in ("train", "validation", "test"):
        ta, tb = pq.read_table(a.files[s]), pq.read_table(b.files[s])
        for c in CRITEO_C:
            assert ta.column(c).equals(tb.column(c)), (s, c)
        assert ta.equals(tb)  # labels and dense values too
    text_hashed = prepare(ConversionSpec(SchemaFormat(spec.model_copy(update={"hex_categorical": []})), csv, 1000))
    assert pq.read_table(text_hashed.files["train"]).column("C1") != pq.read_table(a.files["train"]).column("C1")


def test_hex_categorical_bad_values_and_multi_hot(tmp_path, cache_dir):
    spec = SchemaConfig(label="y", categorical=["c"], multi_hot=["m"], hex_categorical=["c", "m"])
    raw = tmp_path / "r.csv"
    raw.write_text("y,c,m\n1,0000000a,a|ff\n0, 0B ,\n1,zz,1\n0,1,1|x1\n")
    with pytest.raises(DataError, match=r"r.csv, line 4, column c: 'zz' is not a hex number of at most 8 digits"):
        prepare(ConversionSpec(SchemaFormat(spec), raw, 100, split=(1.0, 0.0, 0.0)))
    p = prepare(ConversionSpec(SchemaFormat(spec), raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip"))
    m = json.loads((p.directory / "manifest.json").read_text())
    assert m["rows_written"] == 2 and m["rows_skipped"] == 2
    assert [e["reason"] for e in m["skipped_examples"]] == ["column c: 'zz' is not hex", "column m: '1|x1' is not hex"]
    t = pq.read_table(p.files["train"])
    assert t.column("c").to_pylist() == [1 + 10 % 99, 1 + 11 % 99]  # " 0B " trimmed, read as hex
    assert t.column("m").to_pylist() == [[1 + 10 % 99, 1 + 255 % 99], []]
    with pytest.raises(ConfigError, match=r"data.schema.hex_categorical: \['y'\] are not categorical or multi_hot"):
        config_from_dict(
            {"data": {"format": "schema", "schema": {"label": "y", "categorical": ["c"], "hex_categorical": ["y"]}}}
        )


def test_text_key_is_blake2b_with_an_8_byte_digest():
    """docs/data.md said "the first 8 bytes of the BLAKE2b hash"; the key is BLAKE2b with an
    8-byte digest (a different hash), read little-endian."""
    import hashlib

    keys, present = text_keys(pa.array(["Drama", ""]))
    assert keys[0] == int.from_bytes(hashlib.blake2b(b"Drama", digest_size=8).digest(), "little")
    assert keys[0] != int.from_bytes(hashlib.blake2b(b"Drama").digest()[:8], "little")
    assert present.tolist() == [True, False]


def test_a_null_label_says_missing_and_how_to_skip(tmp_path, cache_dir):
    # It said "'None' is not 0 or 1 (or set a threshold ...)": no threshold helps a null.
    import pyarrow as pa

    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"label": pa.array([1.0, None, 0.0]), "user": pa.array(["a", "b", "c"])}), raw)
    fmt = SchemaFormat(SchemaConfig(label="label", categorical=["user"]))
    with pytest.raises(DataError, match=r"raw.parquet, line 2, column label: the label is missing \(null\); drop"):
        prepare(ConversionSpec(fmt, raw, 100))
    p = prepare(ConversionSpec(fmt, raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip"))
    assert json.loads((p.directory / "manifest.json").read_text())["rows_skipped"] == 1
    # an empty (or blank) CSV field is a missing label too: it said "'' is not a number"
    csv = tmp_path / "raw.csv"
    csv.write_text("label,user\n1,a\n ,b\n0,c\n")
    with pytest.raises(DataError, match=r"raw.csv, line 3, column label: the label is missing \(empty\); drop"):
        prepare(
            ConversionSpec(
                SchemaFormat(SchemaConfig(label="label", label_threshold=0.5, categorical=["user"])), csv, 100
            )
        )


def test_columns_that_reorder_the_header_names_are_refused(tmp_path, cache_dir):
    """columns rename a header line's fields by position: a list written for another order of the
    same fields (another export) swapped user and item silently."""
    raw = tmp_path / "r.csv"
    raw.write_text("click,user,item\n1,u1,i1\n0,u2,i2\n")

    def read(columns, categorical=("user", "item")):
        spec = SchemaConfig(label="click", categorical=list(categorical), header=True, columns=columns)
        return pq.read_table(
            prepare(ConversionSpec(SchemaFormat(spec), raw, 100, split=(1.0, 0.0, 0.0))).files["train"]
        )

    with pytest.raises(DataError, match=r"r.csv, line 1 \(the header line\): .* put 'item' at position 2, where"):
        read(["click", "item", "user"])
    assert read(["click", "user", "item"]).column("user").to_pylist() == ids(["u1", "u2"], 100)
    renamed = read(["click", "u", "i"], ("u", "i"))  # a rename that moves no header name: by position
    assert renamed.column("u").to_pylist() == ids(["u1", "u2"], 100)
