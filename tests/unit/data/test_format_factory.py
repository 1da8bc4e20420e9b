"""A format of the user's (``data.format: package.module:factory`` with ``data.format_args``):
every bad factory or argument is a config error naming ``data.format`` / ``data.format_args.<key>``
before anything is read; never the factory's traceback, and never a run over the wrong columns."""

from __future__ import annotations

import sys
import textwrap

import pytest

from recsys_dist.config import config_from_dict
from recsys_dist.data.resolve import conversion_spec, data_format
from recsys_dist.errors import ConfigError
from tests.cli import ROOT

USER_FORMATS = textwrap.dedent(
    """
    from collections.abc import Sequence
    from recsys_dist.data.config import SchemaConfig
    from recsys_dist.data.formats.schema import SchemaFormat

    def columns(schema, short_lines, *, label: str, categorical: Sequence[str], scale: float = 1.0):
        fmt = SchemaFormat(SchemaConfig(label=label, categorical=list(categorical)))
        fmt.fingerprint = "mine"  # leaves out its arguments: recsys_dist adds them
        return fmt

    def raises(schema, short_lines, *, label: str = "y"):
        return {}[label]

    def no_positionals(*, label: str = "y"):
        return None
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_formats.py").write_text(USER_FORMATS)
    (tmp_path / "broken_formats.py").write_text("def f(:\n    pass\n")
    (tmp_path / "failing_formats.py").write_text("raise RuntimeError('module init failed')\n")
    (tmp_path / "rows.csv").write_text("y,c\n1,a\n0,b\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for m in ("user_formats", "broken_formats", "failing_formats"):
        sys.modules.pop(m, None)


def _config(tmp_path, fmt: str, args: dict | None = None):
    data = {"format": fmt, "raw_path": str(tmp_path / "rows.csv"), "num_embeddings": 10}
    if args is not None:
        data["format_args"] = args
    return config_from_dict({"data": data})


@pytest.mark.parametrize(
    ("fmt", "args", "message"),
    [
        # a module that fails on import: before, its SyntaxError / RuntimeError traceback
        ("broken_formats:f", None, r"data.format: importing module 'broken_formats' failed: SyntaxError"),
        ("failing_formats:f", None, r"data.format: importing module 'failing_formats' failed: RuntimeError: module"),
        # the factory raising: before, its KeyError traceback
        ("user_formats:raises", None, r"data.format: user_formats:raises\(schema, .*raised KeyError: 'y'"),
        # a factory that cannot take (schema, short_lines): before, a TypeError traceback
        ("user_formats:no_positionals", None, r"data.format: user_formats:no_positionals must take \(schema, short"),
        # a required argument left out: before, a TypeError traceback
        ("user_formats:columns", {"label": "y"}, r"data.format_args.categorical: required by user_formats:columns"),
        # a string for a list of columns: before, accepted as the columns 'c', 'a', 't' (a run over
        # missing columns, exit 0)
        (
            "user_formats:columns",
            {"label": "y", "categorical": "cat"},
            r"data.format_args.categorical: user_formats:columns takes categorical: Sequence\[str\]; got 'cat'",
        ),
        (
            "user_formats:columns",
            {"label": "y", "categorical": ["c"], "scale": "big"},
            r"data.format_args.scale: user_formats:columns takes scale: float; got 'big'",
        ),
        ("user_formats:columns", {"label": "y", "categorical": ["c"], "sep": ","}, r"takes no argument 'sep'"),
    ],
)
def test_a_bad_format_factory_or_argument_is_a_config_error(user_module, fmt, args, message):
    with pytest.raises(ConfigError, match=message):
        _config(user_module, fmt, args)


def test_format_args_are_in_the_conversion_cache_key(user_module):
    """A factory whose fingerprint leaves out an argument: other ``data.format_args`` give another
    conversion cache entry (before: the same one, so a run reused Parquet made with other
    arguments, exit 0); the same arguments give the same entry, and the shipped formats' keys
    (no arguments) are unchanged."""
    from recsys_dist.data.convert import entry_path

    def entry(args):
        return entry_path(conversion_spec(_config(user_module, "user_formats:columns", args).data))

    one = {"label": "y", "categorical": ["c"]}
    assert entry(one) == entry(dict(one)) != entry({**one, "scale": 2.0})
    assert data_format(_config(user_module, "user_formats:columns", one).data).fingerprint.startswith("mine|")
    criteo = config_from_dict(
        {"data": {"raw_path": str(ROOT / "datasets/criteo_kaggle/dac_train_first10000.txt"), "num_embeddings": 10}}
    )
    assert data_format(criteo.data).fingerprint == "criteo_tsv"
