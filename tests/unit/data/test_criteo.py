import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.criteo import CRITEO, parse_hex_ids, transform_dense
from recsys_dist.errors import DataError
from tests.conftest import base_row

CATS = [f"{i:08x}" for i in range(1, 27)]


def write(tmp_path, rows, name="raw.txt"):
    p = tmp_path / name
    p.write_text("\n".join(rows) + "\n")
    return p


def test_hex_ids_unsigned_and_in_range():
    ids = parse_hex_ids(pa.array(["ffffffff", "80000000", "7fffffff", "", None, "00000000"]), 1000, "f", 1)
    assert ids.dtype == np.int64
    assert ids.tolist() == [1 + 0xFFFFFFFF % 999, 1 + 0x80000000 % 999, 1 + 0x7FFFFFFF % 999, 0, 0, 1]
    assert (ids >= 0).all() and (ids < 1000).all()


def test_hex_ids_reject_non_hex_with_line():
    with pytest.raises(DataError, match=r"f, line 12: 'zz123456'"):
        parse_hex_ids(pa.array(["00000001", "zz123456"]), 10, "f", 11)
    with pytest.raises(DataError, match="line 1: '123456789'"):
        parse_hex_ids(pa.array(["123456789"]), 10, "f", 1)


def test_dense_log1p_clamps_negative_and_missing():
    out = transform_dense(pa.array([-3, -4, None, 0, 9999999999, 1], type=pa.int64()))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.log1p([0, 0, 0, 0, 9999999999, 1]).astype(np.float32))
    assert np.isfinite(out).all()


def test_prepare_splits_and_transforms(tmp_path, cache_dir):
    rows = [base_row(label=str(i % 2)) for i in range(20)]
    rows[3] = base_row(dense=["-1"] + [""] * 12, cats=[""] * 25 + ["ffffffff"])
    p = prepare(ConversionSpec(CRITEO, write(tmp_path, rows), 100, split=(0.8, 0.1, 0.1)))
    assert p.rows == {"train": 16, "validation": 2, "test": 2}
    train = pq.read_table(p.files["train"])
    assert train.schema.field("C1").type == pa.int64()
    assert train.schema.field("I1").type == pa.float32()
    assert train.column("label").to_pylist()[:4] == [0.0, 1.0, 0.0, 0.0]
    r3 = {k: v[3] for k, v in train.to_pydict().items()}
    assert r3["I1"] == 0.0 and r3["I2"] == 0.0  # -1 -> 0, empty -> 0
    assert r3["C1"] == 0 and r3["C26"] == 1 + 0xFFFFFFFF % 99
    assert train.column("C2").to_pylist()[0] == 1 + 2 % 99
    np.testing.assert_allclose(train.column("I5").to_pylist()[0], np.log1p(5), rtol=1e-6)
    manifest = json.loads((p.directory / "manifest.json").read_text())
    assert manifest["rows"]["train"] == 16 and "log1p" in manifest["transforms"]["dense"]
    # Second call reuses the cache.
    assert prepare(ConversionSpec(CRITEO, tmp_path / "raw.txt", 100)).directory == p.directory


def test_label_missing_on_one_line(tmp_path, cache_dir):
    rows = [base_row(), base_row()[2:], base_row()]  # line 2 lost its label field
    with pytest.raises(DataError, match="raw.txt, line 2: expected 40 fields, got 39"):
        prepare(ConversionSpec(CRITEO, write(tmp_path, rows), 100))


def test_kaggle_test_layout_is_explained(tmp_path, cache_dir):
    rows = [base_row()[2:] for _ in range(5)]
    with pytest.raises(DataError, match="label column seems missing"):
        prepare(ConversionSpec(CRITEO, write(tmp_path, rows), 100))


def test_too_many_fields(tmp_path, cache_dir):
    with pytest.raises(DataError, match="line 2: expected 40 fields, got 41"):
        prepare(ConversionSpec(CRITEO, write(tmp_path, [base_row(), base_row() + "\t1"]), 100))


def test_non_numeric_dense_names_column(tmp_path, cache_dir):
    dense = ["-3", "-4", "abc"] + [str(i) for i in range(4, 14)]
    with pytest.raises(DataError, match=r"raw.txt, column I3, line 2: 'abc' is not an integer"):
        prepare(ConversionSpec(CRITEO, write(tmp_path, [base_row(), base_row(dense=dense)]), 100))


def test_empty_and_missing_file(tmp_path, cache_dir):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="no rows"):
        prepare(ConversionSpec(CRITEO, tmp_path / "empty.txt", 100))
    with pytest.raises(DataError, match="does not exist"):
        prepare(ConversionSpec(CRITEO, tmp_path / "nope.txt", 100))


def test_shipped_sample_converts(cache_dir):
    from tests.conftest import CRITEO_SAMPLE

    p = prepare(ConversionSpec(CRITEO, CRITEO_SAMPLE, 1000))
    assert p.rows == {"train": 8000, "validation": 1000, "test": 1000}
    t = pq.read_table(p.files["train"])
    assert sum(t.column("label").to_pylist()) > 0
    for c in (f"C{i}" for i in range(1, 27)):
        col = t.column(c).to_numpy()
        assert col.min() >= 0 and col.max() < 1000


def test_gzip_rows_counted_after_decompression(tmp_path, cache_dir):
    import gzip

    gz = tmp_path / "raw.txt.gz"
    gz.write_bytes(gzip.compress(("\n".join(base_row(label=str(i % 2)) for i in range(50)) + "\n").encode()))
    p = prepare(ConversionSpec(CRITEO, gz, 100))
    assert p.rows == {"train": 40, "validation": 5, "test": 5}


def test_skip_bad_rows_counts_them(tmp_path, cache_dir):
    rows = [base_row(label=str(i % 2)) for i in range(10)]
    rows.insert(3, base_row()[2:])  # 39 fields
    rows.insert(6, base_row(dense=["abc"] + [str(i) for i in range(2, 14)]))  # bad dense
    rows.insert(9, base_row(cats=["zz"] + [f"{i:08x}" for i in range(2, 27)]))  # bad hex
    p = prepare(ConversionSpec(CRITEO, write(tmp_path, rows), 100, split=(1.0, 0.0, 0.0), on_bad_row="skip"))
    manifest = json.loads((p.directory / "manifest.json").read_text())
    assert manifest["rows_written"] == 10 and manifest["rows_skipped"] == 3
    assert sum(p.rows.values()) == 10
    reasons = " ".join(e["reason"] for e in manifest["skipped_examples"])
    assert "39 fields" in reasons and "column I1: 'abc'" in reasons and "column C1: 'zz'" in reasons
    stats = manifest["dense_stats_train"]["I5"]
    assert stats["mean"] == pytest.approx(np.log1p(5), rel=1e-6) and stats["missing_fraction"] == 0.0
    with pytest.raises(DataError, match="line 4: expected 40 fields, got 39"):
        prepare(ConversionSpec(CRITEO, tmp_path / "raw.txt", 100, split=(1.0, 0.0, 0.0)))


def _short(row: str, fields: int) -> str:
    """``row`` with its trailing fields left out, as some exports write rows whose last fields are empty."""
    return "\t".join(row.split("\t")[:fields])


def test_lines_without_trailing_empty_fields_name_the_short_lines_option(tmp_path, cache_dir):
    """37-39 fields instead of 40 were refused with no hint."""
    for fields in (37, 38, 39):
        rows = [base_row(), _short(base_row(cats=CATS[:-3] + ["", "", ""]), fields), base_row()]
        with pytest.raises(DataError, match=rf"line 2: expected 40 fields, got {fields}.*data.short_lines: pad"):
            prepare(ConversionSpec(CRITEO, write(tmp_path, rows), 100))


def test_short_lines_pad_reads_the_absent_fields_as_missing(tmp_path, cache_dir):
    from recsys_dist.data.convert import ConversionSpec, prepare
    from recsys_dist.data.formats.criteo import CriteoFormat

    empty_tail = [base_row(label=str(i % 2), cats=CATS[: 26 - i % 4] + [""] * (i % 4)) for i in range(20)]
    short = [_short(r, 40 - i % 4) for i, r in enumerate(empty_tail)]  # 40, 39, 38, 37 fields
    short[5] = short[5] + "\r"  # a CRLF line end: the tabs go before the \r
    padded = prepare(ConversionSpec(CriteoFormat(short_lines="pad"), write(tmp_path, short, "short.txt"), 100))
    full = prepare(ConversionSpec(CRITEO, write(tmp_path, empty_tail, "full.txt"), 100))
    assert padded.directory != full.directory and padded.rows == full.rows
    for s in ("train", "validation", "test"):
        assert pq.read_table(padded.files[s]).equals(pq.read_table(full.files[s]))
    assert pq.read_table(padded.files["train"]).column("C26").to_pylist()[:4] == [1 + 0x1A % 99, 0, 0, 0]
    # Blank lines and lines of 41 fields are still bad lines under pad.
    with pytest.raises(DataError, match="line 2: blank line"):
        prepare(
            ConversionSpec(CriteoFormat(short_lines="pad"), write(tmp_path, [base_row(), "", base_row()], "b.txt"), 100)
        )
    with pytest.raises(DataError, match="line 2: expected 40 fields, got 41"):
        prepare(
            ConversionSpec(
                CriteoFormat(short_lines="pad"), write(tmp_path, [base_row(), base_row() + "\t1"], "l.txt"), 100
            )
        )


def test_short_lines_is_a_data_option_of_criteo_only(tmp_path, cache_dir):
    from recsys_dist.config import ConfigError
    from recsys_dist.config.loader import config_from_dict
    from recsys_dist.data.resolve import prepare_from_config

    raw = write(tmp_path, [base_row(), _short(base_row(cats=CATS[:-1] + [""]), 39)] * 5)
    cfg = config_from_dict({"data": {"raw_path": str(raw), "short_lines": "pad", "num_embeddings": 100}})
    assert prepare_from_config(cfg.data).rows == {"train": 8, "validation": 1, "test": 1}
    with pytest.raises(ConfigError, match="data.short_lines: pad only applies to format: criteo_tsv, not avazu_csv"):
        config_from_dict({"data": {"format": "avazu_csv", "short_lines": "pad"}, "model": {"name": "deepfm"}})
