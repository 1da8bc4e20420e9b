import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.avazu import AVAZU, SPARSE_NAMES, hash_ids
from recsys_dist.errors import DataError
from tests.conftest import ROOT

SAMPLE = ROOT / "datasets" / "avazu" / "avazu_train_first8999.csv"
HEADER = SAMPLE.read_text().splitlines()[0]
ROW = "10000169349117863715,1,14102314,1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a,96809ac8,711ee120,1,0,15704,320,50,1722,0,35,-1,79"


def test_hash_ids_are_stable_in_range_and_reserve_zero():
    import pyarrow as pa

    ids = hash_ids(pa.array(["1fbe01fe", "", "1fbe01fe", "x"]), 100)
    assert ids[0] == ids[2] and ids[1] == 0 and ((ids >= 0) & (ids < 100)).all()
    assert ids.tolist() == hash_ids(pa.array(["1fbe01fe", "", "1fbe01fe", "x"]), 100).tolist()


def test_header_optional_id_not_parsed_hour_features(tmp_path, cache_dir):
    with_header = tmp_path / "a.csv"
    with_header.write_text(HEADER + "\n" + ROW + "\n" + ROW.replace(",1,", ",0,", 1) + "\n")
    no_header = tmp_path / "b.csv"
    no_header.write_text(ROW + "\n" + ROW.replace(",1,", ",0,", 1) + "\n")
    got = []
    for path in (with_header, no_header):
        p = prepare(ConversionSpec(AVAZU, path, 1000, split=(1.0, 0.0, 0.0)))
        t = pq.read_table(p.files["train"])
        assert t.num_rows == 2 and t.column("label").to_pylist() == [1.0, 0.0]
        assert t.schema.names == ["label", *SPARSE_NAMES]
        got.append(t)
    assert got[0].equals(got[1])
    # 2014-10-23 was a Thursday (3), hour 14.
    import pyarrow as pa

    assert got[0].column("weekday")[0].as_py() == hash_ids(pa.array(["3"]), 1000)[0]
    assert got[0].column("hour_of_day")[0].as_py() == hash_ids(pa.array(["14"]), 1000)[0]


def test_bad_click_and_field_count(tmp_path, cache_dir):
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "\n" + ROW + "\n" + ROW.replace(",1,", ",2,", 1) + "\n")
    with pytest.raises(DataError, match=r"bad.csv, line 3, column click: '2' \(0 or 1 expected\)"):
        prepare(ConversionSpec(AVAZU, bad, 1000))
    short = tmp_path / "short.csv"
    short.write_text(HEADER + "\n" + ROW + "\n" + ROW.rsplit(",", 1)[0] + "\n")
    with pytest.raises(DataError, match="short.csv, line 3: expected 24 fields, got 23"):
        prepare(ConversionSpec(AVAZU, short, 1000))
    p = prepare(ConversionSpec(AVAZU, short, 1000, split=(1.0, 0.0, 0.0), on_bad_row="skip"))
    manifest = json.loads((p.directory / "manifest.json").read_text())
    assert manifest["rows_written"] == 1 and manifest["rows_skipped"] == 1


def test_shipped_sample(cache_dir):
    p = prepare(ConversionSpec(AVAZU, SAMPLE, 5000))
    assert p.rows == {"train": 7199, "validation": 900, "test": 900}
    t = pq.read_table(p.files["train"])
    assert 0.15 < np.mean(t.column("label").to_numpy()) < 0.2
    assert all(0 <= t.column(n).to_numpy().min() and t.column(n).to_numpy().max() < 5000 for n in SPARSE_NAMES)
