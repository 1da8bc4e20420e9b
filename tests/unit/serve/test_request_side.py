"""The request side of a scoring request belongs to the format (``RawFormat.request_layout``):
``serve/`` names no format, and each shipped format's layout keeps the rows and messages it had."""

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import recsys_dist.serve as serve
from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.formats.base import RequestLayout
from recsys_dist.data.resolve import raw_format
from recsys_dist.errors import BadRequest
from recsys_dist.serve.request_rows import RowWriter

CRITEO_ROW = {"label": 1, "I1": 3, **{f"C{i}": "68fd1e64" for i in range(1, 27)}}


def test_serve_names_no_format():
    """What a format's rows are is the format's (criteo_tsv, avazu_csv, schema were ~20 branches
    in serve/request_rows.py and serve/inmemory.py): a format of one's own is served the same way."""
    pattern = re.compile(r"criteo_tsv|avazu_csv|format [!=]= \"schema\"")
    found = [
        f"{f.name}:{n}: {line.strip()}"
        for f in sorted(Path(serve.__file__).parent.glob("*.py"))
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def _schema(**extra):
    return SchemaConfig(label="y", dense=["d"], categorical=["c"], multi_hot=["m"], separator="|", **extra)


@pytest.mark.parametrize("name", ["criteo_tsv", "avazu_csv", "schema"])
def test_every_shipped_format_has_a_request_layout(name):
    fmt = raw_format(name, _schema() if name == "schema" else None)
    layout = fmt.request_layout()
    assert isinstance(layout, RequestLayout)
    assert set(layout.list_columns) <= set(layout.columns)
    assert layout.reader().sparse_names == fmt.sparse_names


def test_criteo_rows_are_its_unlabelled_layout(tmp_path):
    w = RowWriter(raw_format("criteo_tsv"))
    path = w.write([CRITEO_ROW], tmp_path)
    assert path.name == "rows.txt" and w.header_lines == 0
    fields = path.read_text().rstrip("\n").split("\t")
    assert len(fields) == 39 and fields[:2] == ["3", ""]  # no label; I2 missing
    with pytest.raises(BadRequest, match=r"^rows\[0\], column C2: a value may not hold a line break or a tab$"):
        w.write([{**CRITEO_ROW, "C2": "a\tb"}], tmp_path)
    with pytest.raises(BadRequest, match=r"unknown column 'x' for format criteo_tsv \(its columns: label, I1..I13, C1"):
        w.write([{**CRITEO_ROW, "x": 1}], tmp_path)


def test_avazu_rows_get_placeholders_and_refuse_commas(tmp_path):
    w = RowWriter(raw_format("avazu_csv"))
    path = w.write([{"hour": 14102100, "C1": 1005, "site_id": "1fbe01fe", "click": 1}], tmp_path)
    header, line = path.read_text().splitlines()
    assert path.name == "rows.csv" and w.header_lines == 1 and header.startswith("id,click,hour,C1,")
    assert line == "0,0,14102100,1005,,1fbe01fe" + "," * 18  # id and click placeholders
    with pytest.raises(BadRequest, match=r"column C1: a value may not hold a line break or a comma$"):
        w.write([{"C1": "a,b"}], tmp_path)
    with pytest.raises(BadRequest, match=r"column C1: a value may not hold a line break or a tab$"):
        w.write([{"C1": "a\nb"}], tmp_path)


def test_schema_rows_are_quoted_csv_or_parquet(tmp_path):
    w = RowWriter(raw_format("schema", _schema()))
    path = w.write([{"y": 1, "d": 1.5, "c": "a,b", "m": ["x", "y"]}], tmp_path)
    assert path.read_text() == 'd,c,m\n1.5,"a,b",x|y\n' and w.header_lines == 1  # label left out
    with pytest.raises(BadRequest, match="names no columns"):
        w.write(["1.5,a,x"], tmp_path)
    w = RowWriter(raw_format("schema", _schema(file_type="parquet")))
    path = w.write([{"d": 1.5, "c": "a", "m": ["x", "y"]}], tmp_path)
    assert pq.read_table(path).to_pylist() == [{"d": "1.5", "c": "a", "m": ["x", "y"]}]
    with pytest.raises(BadRequest, match=r"reads Parquet \(data.schema.file_type: parquet\)"):
        w.write(["1.5,a,x"], tmp_path)


def test_a_format_without_a_request_side_trains_and_is_refused_by_serve_by_name():
    """``request_layout`` is optional: a format made for training only resolves, and serving
    it is one ConfigError naming data.format, not an AttributeError per request."""
    from recsys_dist.data.formats.base import FORMATS
    from recsys_dist.data.resolve import raw_format
    from recsys_dist.errors import ConfigError
    from recsys_dist.serve.request_rows import RowWriter, check_servable

    class TrainOnly:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name == "request_layout":
                raise AttributeError(name)
            return getattr(self._inner, name)

    FORMATS["train_only_toy"] = lambda schema, short_lines="error": TrainOnly(FORMATS["criteo_tsv"](None, "error"))
    try:
        fmt = raw_format("train_only_toy")
        assert fmt.dense_names[0] == "I1"
        with pytest.raises(ConfigError, match="data.format: criteo_tsv .*has no request side"):
            check_servable(fmt)
        with pytest.raises(ConfigError, match="has no request side"):
            RowWriter(fmt)
    finally:
        del FORMATS["train_only_toy"]
