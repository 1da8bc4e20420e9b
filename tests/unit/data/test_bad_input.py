"""Bad raw input: every line is a row or a counted bad line, and the error names the file,
line and column (cases that cannot be corpus text: gzip, bytes that are not UTF-8, Parquet)."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.avazu import AVAZU
from recsys_dist.data.formats.criteo import CRITEO
from recsys_dist.data.formats.schema import SchemaFormat
from recsys_dist.data.text import count_rows, parse_ints
from recsys_dist.errors import DataError
from tests.conftest import base_row
from tests.unit.data.test_avazu import HEADER, ROW

ML = SchemaConfig(label="rating", label_threshold=4.0, categorical=["userId", "movieId"], multi_hot=["genres"])


def ml_csv(n: int = 300) -> list[str]:
    return ["userId,movieId,rating,timestamp,genres"] + [
        f"{i % 7},{i % 11},{(i % 5) + 0.5},{1260759144 + i},Drama|Comedy" for i in range(n)
    ]


def manifest(p) -> dict:
    return json.loads((p.directory / "manifest.json").read_text())


# 1. an unclosed quote must not swallow the rest of the file
def test_unclosed_quote_stops_or_is_counted_never_swallows_lines(tmp_path, cache_dir):
    lines = ml_csv()
    lines[82] = '1,2,4.0,1260759144,"Drama'  # file line 83
    raw = tmp_path / "r.csv"
    raw.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"r.csv, line 83: column genres: a quoted field is not closed"):
        prepare(ConversionSpec(SchemaFormat(ML), raw, 100))
    p = prepare(ConversionSpec(SchemaFormat(ML), raw, 100, on_bad_row="skip"))
    m = manifest(p)
    assert m["rows_written"] == 299 and m["rows_skipped"] == 1  # every other line is a row
    assert m["skipped_examples"][0]["line"] == 83
    # A well-quoted field and a quote inside a field are fine.
    lines[82] = '1,2,4.0,1260759144,"Drama|Film ""Noir"""'
    lines[83] = '1,2,4.0,1260759144,Dra"ma'
    raw.write_text("\n".join(lines) + "\n")
    assert sum(prepare(ConversionSpec(SchemaFormat(ML), raw, 100)).rows.values()) == 300


# 2. a wrong field count names the line (pyarrow's threaded parse does not know it)
def test_schema_field_count_names_the_line(tmp_path, cache_dir):
    lines = ml_csv()
    lines[51] = "1,2,4.0,1260759144"
    raw = tmp_path / "r.csv"
    raw.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"r.csv, line 52: expected 5 fields, got 4 \(the columns are"):
        prepare(ConversionSpec(SchemaFormat(ML), raw, 100))
    m = manifest(prepare(ConversionSpec(SchemaFormat(ML), raw, 100, on_bad_row="skip")))
    assert m["rows_written"] == 299 and m["rows_skipped"] == 1


# 3. blank lines are bad lines: an error naming the line, or skipped and counted
def test_blank_lines_are_bad_lines_in_every_format(tmp_path, cache_dir):
    rows = [base_row(label=str(i % 2)) for i in range(300)]
    rows[100:100] = [""]
    rows[200:200] = ["\r"]  # a CRLF blank line
    raw = tmp_path / "blank.txt"
    raw.write_text("\n".join(rows) + "\n")
    assert count_rows(raw) == 302
    with pytest.raises(DataError, match=r"blank.txt, line 101: blank line"):
        prepare(ConversionSpec(CRITEO, raw, 100))
    p = prepare(ConversionSpec(CRITEO, raw, 100, on_bad_row="skip"))
    m = manifest(p)
    assert m["rows_written"] == 300 and m["rows_skipped"] == 2  # rows read = written + skipped
    # the fractions apply to the rows kept: skipped lines do not all come out of the test split
    assert m["split"]["row_bounds"] == [0, 240, 270, 300] and p.rows == {"train": 240, "validation": 30, "test": 30}
    assert [e["line"] for e in m["skipped_examples"]] == [101, 201]
    av = tmp_path / "a.csv"
    av.write_text(HEADER + "\n" + ROW + "\n\n" + ROW + "\n")
    with pytest.raises(DataError, match=r"a.csv, line 3: blank line"):
        prepare(ConversionSpec(AVAZU, av, 100))
    ml = tmp_path / "m.csv"
    ml.write_text("\n".join(ml_csv(10)[:5] + [""] + ml_csv(10)[5:]) + "\n")
    with pytest.raises(DataError, match=r"m.csv, line 6: blank line"):
        prepare(ConversionSpec(SchemaFormat(ML), ml, 100))


@pytest.mark.parametrize("mapping", ["hash", "vocabulary"])
def test_skipped_rows_leave_the_position_split_exact(tmp_path, cache_dir, mapping):
    good = [base_row(label=str(i % 2), dense=[str(i + j) for j in range(13)]) for i in range(300)]
    lines = list(good)
    for k in range(30):  # 30 bad lines spread over the file: wrong field count and a bad value
        lines.insert(11 * k + 5, "1\t2" if k % 2 else base_row(dense=["abc"] + [str(j) for j in range(12)]))
    raw, clean = tmp_path / "dirty.txt", tmp_path / "clean.txt"
    raw.write_text("\n".join(lines) + "\n")
    clean.write_text("\n".join(good) + "\n")
    p = prepare(ConversionSpec(CRITEO, raw, 100, on_bad_row="skip", mapping=mapping, row_group_size=64))
    want = prepare(ConversionSpec(CRITEO, clean, 100, mapping=mapping, row_group_size=64))
    m, mw = manifest(p), manifest(want)
    assert (m["rows_written"], m["rows_skipped"]) == (300, 30)
    assert p.rows == want.rows == {"train": 240, "validation": 30, "test": 30}
    assert m["split"]["row_bounds"] == [0, 240, 270, 300]
    for n, v in mw["dense_stats_train"].items():  # summed in other batches: equal to rounding
        assert m["dense_stats_train"][n] == pytest.approx(v, rel=1e-9), n
    for s in ("train", "validation", "test"):
        f = pq.ParquetFile(p.files[s])
        assert f.read().equals(pq.read_table(want.files[s]))
        sizes = [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)]
        assert all(n == 64 for n in sizes[:-1]), sizes  # whole row groups after the cut too


def test_num_rows_reads_only_that_many_lines(tmp_path, cache_dir):
    lines = [base_row(label=str(i % 2)) for i in range(300)]
    lines[200] = "1\t2"  # line 201, after the cap: never looked at
    raw = tmp_path / "r.txt"
    raw.write_text("\n".join(lines) + "\n")
    p = prepare(ConversionSpec(CRITEO, raw, 100, num_rows=100))
    assert p.rows == {"train": 80, "validation": 10, "test": 10}
    lines[49] = ""  # line 50, inside the cap: read, and skipped as bad
    raw.write_text("\n".join(lines) + "\n")
    m = manifest(prepare(ConversionSpec(CRITEO, raw, 100, num_rows=100, on_bad_row="skip")))
    assert (m["rows_written"], m["rows_skipped"]) == (99, 1)
    assert [e["line"] for e in m["skipped_examples"]] == [50]
    av = tmp_path / "a.csv"  # a header line is not a row
    av.write_text(HEADER + "\n" + "\n".join([ROW] * 5 + ["1,2"]) + "\n")
    assert sum(prepare(ConversionSpec(AVAZU, av, 100, num_rows=5)).rows.values()) == 5


def test_every_skipped_row_is_reported_by_its_file_line(tmp_path, cache_dir):
    rows = [base_row() for _ in range(10)]
    rows[2] = ""  # line 3: removed before parsing
    rows[4] = "1\t2"  # line 5: wrong field count (pyarrow's threaded parse does not tell the line)
    rows[6] = base_row(cats=["ZZZZZZZZ"] + [f"{i:08x}" for i in range(2, 27)])  # line 7: a bad value
    rows[8] = base_row(dense=["abc"] + [str(i) for i in range(2, 14)])  # line 9: a bad value
    raw = tmp_path / "r.txt"
    raw.write_text("\n".join(rows) + "\n")
    m = manifest(prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
    assert [(e["line"], e["reason"]) for e in m["skipped_examples"]] == [
        (3, "blank line"),
        (5, "2 fields, expected 40"),
        (7, "column C1: 'ZZZZZZZZ'"),
        (9, "column I1: 'abc'"),
    ]
    av = tmp_path / "a.csv"  # a header: file lines count it
    av.write_text(HEADER + "\n" + ROW + "\n" + ROW.replace("14102314", "14133100") + "\n")
    m = manifest(prepare(ConversionSpec(AVAZU, av, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
    assert [e["line"] for e in m["skipped_examples"]] == [3]


@pytest.mark.parametrize(
    "bad",
    [
        {5: "1\t2", 50: ""},  # a wrong field count before a blank line (blank lines were found first)
        {5: "1\t2", 50: b"\xff\xfe\t1"},  # ... before a line that is not UTF-8 text
        {5: base_row(dense=["abc"] + [str(i) for i in range(2, 14)]), 50: "1\t2"},  # a bad value before a field count
        {3: base_row(cats=["ZZZZZZZZ"] + [f"{i:08x}" for i in range(2, 27)]), 5: base_row(dense=["abc"] * 13)},
    ],
    ids=["count-blank", "count-utf8", "value-count", "value-value"],
)
def test_the_first_bad_line_is_the_one_named(tmp_path, cache_dir, bad):
    """on_bad_row: error names the first bad line of the file, whatever the kinds of the bad
    lines (it named a later one: the kinds were looked for in turn, values after the block's
    field counts, the columns in order); under skip the examples come in line order."""
    rows = [base_row(label=str(i % 2)).encode() for i in range(200)]
    for line, text in bad.items():
        rows[line - 1] = text if isinstance(text, bytes) else text.encode()
    raw = tmp_path / "r.txt"
    raw.write_bytes(b"\n".join(rows) + b"\n")
    first = min(bad)
    with pytest.raises(DataError, match=rf"r.txt, (column \w+, )?line {first}\b"):
        prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0)))
    m = manifest(prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
    assert m["rows_skipped"] == 2 and [e["line"] for e in m["skipped_examples"]] == sorted(bad)


def test_the_first_bad_line_is_the_one_named_in_avazu_and_schema_files(tmp_path, cache_dir):
    av = tmp_path / "a.csv"
    av.write_text(HEADER + "\n" + ROW + "\n" + ROW.replace(",1,", ",7,", 1) + "\n\n" + ROW + "\n1,2\n")
    with pytest.raises(DataError, match=r"a.csv, line 3, column click"):  # line 4 blank, line 6 two fields
        prepare(ConversionSpec(AVAZU, av, 100, split=(1.0, 0.0, 0.0)))
    ml = ml_csv(20)
    ml[3], ml[9] = "1,2,x,3,Drama", "1,2"
    (tmp_path / "m.csv").write_text("\n".join(ml[:12] + [""] + ml[12:]) + "\n")
    with pytest.raises(DataError, match=r"m.csv, column rating, line 4: 'x' is not a number"):
        prepare(ConversionSpec(SchemaFormat(ML), tmp_path / "m.csv", 100, split=(1.0, 0.0, 0.0)))


def test_blank_lines_without_skip_keep_the_split_exact(tmp_path, cache_dir):
    raw = tmp_path / "raw.txt"
    raw.write_text("".join(base_row(label=str(i % 2)) + "\n" for i in range(300)))
    p = prepare(ConversionSpec(CRITEO, raw, 100))
    assert p.rows == {"train": 240, "validation": 30, "test": 30}
    assert manifest(p)["split"]["row_bounds"] == [0, 240, 270, 300]


# 5. a dense value with a plus sign
def test_dense_plus_sign_is_accepted(tmp_path, cache_dir):
    assert parse_ints(pa.array(["+5", " +7 ", "-3", ""]), "f", 1).to_pylist() == [5, 7, -3, None]
    dense = ["+5"] + [str(i) for i in range(2, 14)]
    raw = tmp_path / "raw.txt"
    raw.write_text(base_row() + "\n" + base_row(label="1", dense=dense) + "\n")
    t = pq.read_table(prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0))).files["train"])
    np.testing.assert_allclose(t.column("I1").to_pylist()[1], np.log1p(5), rtol=1e-6)


# 5b. integers parsed by the CSV reader (fast path) or, for a block where one does not
# convert, as text (the fallback): the same output, and the same skipped rows
def test_integer_fast_path_and_text_fallback_agree(tmp_path, cache_dir):
    rows = [
        base_row(label=str(i % 2), dense=[str(i * j - 40) if j % 4 else "" for j in range(1, 14)]) for i in range(60)
    ]
    clean, odd = tmp_path / "clean.txt", tmp_path / "odd.txt"
    clean.write_text("\n".join(rows) + "\n")
    rows[30] = rows[30].replace("\t", "\t+", 2).replace("\t+", "\t", 1)  # I2 "+x": text path only
    odd.write_text("\n".join(rows) + "\n")
    a = prepare(ConversionSpec(CRITEO, clean, 100, split=(1.0, 0.0, 0.0)))
    b = prepare(ConversionSpec(CRITEO, odd, 100, split=(1.0, 0.0, 0.0)))
    assert pq.read_table(a.files["train"]).equals(pq.read_table(b.files["train"]))
    assert manifest(a)["dense_stats_train"] == manifest(b)["dense_stats_train"]
    # skip: a bad label on the fast path and a bad integer on the fallback are counted alike
    for bad_field, why in ((0, "column label: '2'"), (3, "column I3: 'x1'")):
        fields = rows[0].split("\t")
        fields[bad_field] = "2" if bad_field == 0 else "x1"
        raw = tmp_path / f"bad{bad_field}.txt"
        raw.write_text("\n".join([rows[1], "\t".join(fields), rows[2]]) + "\n")
        m = manifest(prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
        assert (m["rows_written"], m["rows_skipped"]) == (2, 1)
        assert why in m["skipped_examples"][0]["reason"]
        with pytest.raises(DataError, match=r"line 2, column label|column I3, line 2"):
            prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0)))


# 5c. one definition of an integer whichever path parses the block: a value is accepted
# or refused the same with or without another bad value (which forces the text path) near it
@pytest.mark.parametrize(
    "column,value,ok",
    [
        ("I2", "0x10", False),
        ("I2", "1000000000000000000", False),
        ("I2", "0000000000000000001", True),
        ("I2", " 7", True),
        ("I2", "+5", True),
        ("I2", "-0", True),
        ("I2", "999999999999999999", True),
        ("label", "01", True),
        ("label", "-0", True),
        ("label", "+1", True),
        ("label", "0x1", False),
        ("label", "-1", False),
    ],
)
def test_integer_verdict_does_not_depend_on_the_block(tmp_path, cache_dir, column, value, ok):
    rows = [base_row(label=str(i % 2)) for i in range(6)]
    fields = rows[2].split("\t")
    fields[0 if column == "label" else 2] = value
    rows[2] = "\t".join(fields)
    other = rows[4].split("\t")
    other[3] = "1.5"  # I3: not an integer on any path
    for name, lines in (("alone", rows), ("with_other", rows[:4] + ["\t".join(other)] + rows[5:])):
        raw = tmp_path / f"{name}.txt"
        raw.write_text("\n".join(lines) + "\n")
        m = manifest(prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
        skipped_lines = {e["line"] for e in m["skipped_examples"]}
        assert (3 in skipped_lines) == (not ok), (name, m["skipped_examples"])
        if ok and name == "alone":
            prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0)))  # no error
        elif not ok:
            with pytest.raises(DataError, match="line 3"):
                prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0)))


# 6. Avazu: impossible hours, file lines, a byte order mark
@pytest.mark.parametrize("hour", ["14133100", "14023000", "14102124", "abc", ""])
def test_avazu_impossible_hour_names_line_and_column(tmp_path, cache_dir, hour):
    raw = tmp_path / "a.csv"
    raw.write_text(HEADER + "\n" + ROW + "\n" + ROW.replace("14102314", hour) + "\n" + ROW + "\n")
    with pytest.raises(DataError, match=rf"a.csv, line 3, column hour: '{hour}' \(YYMMDDHH"):
        prepare(ConversionSpec(AVAZU, raw, 100))
    m = manifest(prepare(ConversionSpec(AVAZU, raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
    assert m["rows_written"] == 2 and m["rows_skipped"] == 1
    headerless = tmp_path / "b.csv"
    headerless.write_text(ROW + "\n" + ROW.replace("14102314", hour) + "\n")
    with pytest.raises(DataError, match=r"b.csv, line 2, column hour"):
        prepare(ConversionSpec(AVAZU, headerless, 100))


def test_avazu_header_after_byte_order_mark(tmp_path, cache_dir):
    raw = tmp_path / "a.csv"
    raw.write_bytes(b"\xef\xbb\xbf" + (HEADER + "\n" + ROW + "\n" + ROW + "\n").encode())
    assert AVAZU.count_rows(raw) == 2
    assert prepare(ConversionSpec(AVAZU, raw, 100, split=(1.0, 0.0, 0.0))).rows["train"] == 2


# 8. Parquet that cannot be read, a binary column that is not UTF-8
def test_bad_parquet_names_file_and_column(tmp_path, cache_dir, capsys):
    garbage = tmp_path / "g.parquet"
    garbage.write_bytes(bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8)))
    with pytest.raises(DataError, match=r"g.parquet: cannot read as Parquet \(.*magic bytes"):
        prepare(ConversionSpec(SchemaFormat(ML), garbage, 100))
    binary = tmp_path / "b.parquet"
    pq.write_table(
        pa.table(
            {
                "rating": [5.0, 1.0, 3.0],
                "userId": ["1", "2", "3"],
                "movieId": pa.array([b"a", b"\xff\xfe", b"c"], pa.binary()),
                "genres": ["x|y", "z", ""],
            }
        ),
        binary,
    )
    with pytest.raises(DataError, match=r"b.parquet, row 2, column movieId: b'\\xff\\xfe' is not UTF-8 text"):
        prepare(ConversionSpec(SchemaFormat(ML), binary, 100))


# 9. NaN is refused like inf (empty is the missing value)
def test_dense_nan_is_refused_like_inf(tmp_path, cache_dir):
    spec = SchemaConfig(label="rating", label_threshold=4.0, dense=["ts"], categorical=["userId"])
    raw = tmp_path / "r.csv"
    for bad in ("NaN", "nan", "inf", "-Infinity"):
        raw.write_text(f"userId,rating,ts\n1,5.0,3\n2,1.0,{bad}\n3,4.0,\n")
        with pytest.raises(DataError, match=rf"r.csv, line 3, column ts: '{bad}' is not a finite number"):
            prepare(ConversionSpec(SchemaFormat(spec), raw, 100))
        m = manifest(prepare(ConversionSpec(SchemaFormat(spec), raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
        assert m["rows_written"] == 2 and m["rows_skipped"] == 1
    raw.write_text("userId,rating,ts\n1,5.0,3\n2,inf,4\n")
    with pytest.raises(DataError, match=r"line 3, column rating: 'inf' is not a finite number"):
        prepare(ConversionSpec(SchemaFormat(spec), raw, 100))
    par = tmp_path / "r.parquet"
    pq.write_table(
        pa.table({"rating": [5.0, 1.0, 3.0], "userId": ["a", "b", "c"], "ts": [1.0, float("nan"), None]}), par
    )
    with pytest.raises(DataError, match=r"r.parquet, row 2, column ts: 'nan' is not a finite number"):
        prepare(ConversionSpec(SchemaFormat(spec), par, 100))
    m = manifest(prepare(ConversionSpec(SchemaFormat(spec), par, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
    assert m["rows_written"] == 2 and m["rows_skipped"] == 1  # null is missing, NaN is bad


# 10. one label value in the training split: a warning, not an error
def test_one_class_training_split_warns(tmp_path, cache_dir, capsys):
    raw = tmp_path / "r.csv"
    raw.write_text("userId,movieId,rating,genres\n1,2,1,a\n2,3,0,b\n3,4,1,c\n")
    p = prepare(ConversionSpec(SchemaFormat(ML), raw, 100, split=(1.0, 0.0, 0.0)))
    assert p.rows["train"] == 3
    err = capsys.readouterr().err
    assert "all 3 training rows have label 0" in err and "rating >= 4" in err and "remove label_threshold" in err
    raw.write_text("userId,movieId,rating,genres\n1,2,5,a\n2,3,1,b\n")
    prepare(ConversionSpec(SchemaFormat(ML), raw, 100, split=(1.0, 0.0, 0.0)))
    assert "training rows" not in capsys.readouterr().err
