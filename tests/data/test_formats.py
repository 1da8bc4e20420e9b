"""The format registry is the one list of format names, and every format has the whole interface."""

from typing import get_args

import pytest

from recsys_dist.data.config import DataConfig, SchemaConfig
from recsys_dist.data.formats.base import FORMATS, RawFormat, register_format
from recsys_dist.data.resolve import raw_format


def test_the_config_literal_lists_the_registered_formats():
    assert set(get_args(DataConfig.model_fields["format"].annotation)) == set(FORMATS)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_has_the_raw_format_interface(name):
    schema = SchemaConfig(label="y", dense=["d"], categorical=["c"]) if name == "schema" else None
    fmt = raw_format(name, schema)
    assert isinstance(fmt, RawFormat)
    assert fmt.name == name and fmt.fingerprint.startswith(name)
    assert len(fmt.task_names) == len(fmt.task_kinds) == len(fmt.label_columns)
    assert set(fmt.sequence_names) <= set(fmt.sparse_names)


def test_unknown_and_duplicate_format_names_are_errors():
    with pytest.raises(ValueError, match="unknown format 'parquet'; known: "):
        raw_format("parquet")
    with pytest.raises(ValueError, match="registered twice"):
        register_format("criteo_tsv")(lambda schema, short_lines: None)
