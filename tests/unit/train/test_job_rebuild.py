"""A Job that a process cannot rebuild (a spawned rank that cannot import the user's format or
model module) unpickles, and raises on first use with the config key, the cause and the fix;
and a model module that fails to import is a config error naming ``model.name``."""

from __future__ import annotations

import dataclasses
import pickle
import sys
import textwrap

import pytest

import recsys_dist
from recsys_dist.config import config_from_dict
from recsys_dist.errors import ConfigError
from recsys_dist.models import registry
from tests.cli import ROOT

FORMAT = textwrap.dedent(
    """
    from recsys_dist.data.config import SchemaConfig
    from recsys_dist.data.formats.schema import SchemaFormat

    def csv(schema, short_lines, *, label: str, categorical: list[str]):
        return SchemaFormat(SchemaConfig(label=label, categorical=categorical))
    """
)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "rebuild_formats.py").write_text(FORMAT)
    (tmp_path / "broken_model.py").write_text("import no_such_dependency_of_mine\n")
    (tmp_path / "syntax_model.py").write_text("def f(:\n    pass\n")
    (tmp_path / "rows.csv").write_text("y,c\n1,a\n0,b\n1,c\n0,d\n1,e\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for m in ("rebuild_formats", "broken_model", "syntax_model"):
        sys.modules.pop(m, None)


def test_a_job_whose_modules_cannot_be_imported_unpickles_and_says_why_on_use(user_dir, monkeypatch):
    """Before: ``pickle.loads`` raised, which on a spawned rank happens before its code runs, so
    ``recsys_dist.launch`` reported only "rank 0 failed: To enable traceback see ...". Now the
    rank's first use of the format (or model) raises, and the launcher reports that error."""
    data = {
        "format": "rebuild_formats:csv",
        "format_args": {"label": "y", "categorical": ["c"]},
        "raw_path": str(user_dir / "rows.csv"),
        "num_embeddings": 10,
    }
    cfg = config_from_dict({"data": data})
    job = recsys_dist.resolve_job(cfg)
    # a model registered under `if __name__ == "__main__":` of the launching script: the rank lacks it
    spec = registry._MODELS["dlrm"]
    monkeypatch.setitem(registry._MODELS, "mine_only_here", spec)
    model = job.model.model_copy(update={"name": "mine_only_here"})
    job = dataclasses.replace(job, model=model, model_spec=spec)
    blob = pickle.dumps(job)
    monkeypatch.delitem(registry._MODELS, "mine_only_here")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(user_dir)])
    sys.modules.pop("rebuild_formats", None)

    back = pickle.loads(blob)  # before: ValueError here
    assert back.to_dict() == job.to_dict() and back.features.keys == job.features.keys
    with pytest.raises(ValueError, match=r"data.format: cannot import module 'rebuild_formats'.*PYTHONPATH"):
        _ = back.fmt.sparse_names
    with pytest.raises(ValueError, match=r"model.name: 'mine_only_here' is not registered here.*top level"):
        _ = back.model_spec.build
    pickle.loads(pickle.dumps(back))  # and it travels on


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("broken_model:f", r"model.name: cannot import module 'broken_model'.*PYTHONPATH"),
        # before: the SyntaxError's traceback
        ("syntax_model:f", r"model.name: importing module 'syntax_model' failed: SyntaxError"),
    ],
)
def test_a_model_module_that_fails_to_import_is_a_config_error(user_dir, name, message):
    data = {"raw_path": str(ROOT / "datasets/criteo_kaggle/dac_train_first10000.txt"), "num_embeddings": 10}
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"data": data, "model": {"name": name}})
