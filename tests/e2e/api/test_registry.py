"""Models and losses by name, by registration and by import path; per-model options."""

import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from tests.conftest import QUICKSTART
from tests.unit.api import test_registry as unit_test_registry
from tests.unit.api.test_registry import (
    EXAMPLE,
)

example_on_path = unit_test_registry.example_on_path  # the fixture, shared with tests.unit.api.test_registry


def test_model_args_types_are_checked_before_launch(example_on_path, tmp_path):
    """model.args={hidden: wide} passed load_config and failed on every rank (a traceback from
    each, exit 1); now the factory's annotations are checked when the config loads (exit 2)."""
    from recsys_dist.cli import main as cli

    with pytest.raises(ConfigError, match=r"model\.args\.hidden: my_model:DotTower takes hidden: int; got 'wide'"):
        load_config(QUICKSTART, ["model.name=my_model:DotTower", "model.args={hidden: wide}"])
    with pytest.raises(ConfigError, match=r"model\.args\.hidden: .* got 8\.5 \(float\)"):
        load_config(QUICKSTART, ["model.name=my_model:DotTower", "model.args={hidden: 8.5}"])
    assert load_config(QUICKSTART, ["model.name=my_model:DotTower", "model.args={hidden: '8'}"]).model.args == {
        "hidden": 8
    }
    argv = ["train", "--config", EXAMPLE / "config.yaml", "--run-dir", tmp_path / "run", "model.args.hidden=[64]"]
    assert cli.main([str(a) for a in argv]) == 2
