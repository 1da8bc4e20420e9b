"""The format registry is the one list of format names, and every format has the whole interface."""

import pytest

from recsys_dist.data.config import DataConfig, SchemaConfig
from recsys_dist.data.formats.base import FORMATS, RawFormat, register_format
from recsys_dist.data.resolve import raw_format


def test_the_config_names_no_format_list_of_its_own():
    """``data.format`` is checked against the registry (``data.resolve.check_data``), so a format
    registered (or named by import path) is usable from YAML with no list to edit."""
    assert DataConfig.model_fields["format"].annotation is str
    assert {"criteo_tsv", "avazu_csv", "schema"} <= set(FORMATS)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_has_the_raw_format_interface(name):
    schema = SchemaConfig(label="y", dense=["d"], categorical=["c"]) if name == "schema" else None
    fmt = raw_format(name, schema)
    assert isinstance(fmt, RawFormat)
    assert fmt.name == name and fmt.fingerprint.startswith(name)
    assert len(fmt.task_names) == len(fmt.task_kinds) == len(fmt.label_columns)
    assert set(fmt.sequence_names) <= set(fmt.sparse_names)


def test_unknown_and_duplicate_format_names_are_errors():
    with pytest.raises(ValueError, match="unknown format 'parquet'; registered: avazu_csv, criteo_tsv, schema"):
        raw_format("parquet")
    with pytest.raises(ValueError, match="registered twice"):
        register_format("criteo_tsv")(lambda schema, short_lines: None)


def test_the_converter_takes_its_format_object_and_names_no_format():
    """``recsys_dist.data.convert`` converts whatever format object it is given: it imports no
    concrete format (``prepare_criteo``, kept for tests, imported ``CRITEO`` into it). The one
    exception, ``TRANSFORM_VERSION`` in the cache key, is a constant of every format's transforms."""
    import ast
    from pathlib import Path

    import recsys_dist.data.convert as convert

    concrete = {f"recsys_dist.data.formats.{m}" for m in ("criteo", "avazu", "schema", "history")}
    found = []
    for f in Path(convert.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in concrete:
                found += [f"{f.name}: {a.name}" for a in node.names if a.name != "TRANSFORM_VERSION"]
    assert not found, found
