"""Config of publishing for incremental reload: publish.full_every and publish.overwrite (the reload
and compaction themselves are tested in tests/e2e/serve/test_reload.py).
"""

import pytest

from recsys_dist.config.loader import config_from_dict
from recsys_dist.errors import ConfigError


def test_full_every_config():
    base = {"data": {"format": "criteo_tsv", "raw_path": "x.txt"}}
    ok = config_from_dict({**base, "publish": {"enabled": True, "every_partition": True, "full_every": 24}}, "c.yaml")
    assert ok.publish.full_every == 24
    default = config_from_dict({**base, "publish": {"enabled": True, "every_partition": True}}, "c.yaml")
    assert default.publish.full_every is None
    with pytest.raises(ConfigError, match="full_every"):
        config_from_dict({**base, "publish": {"enabled": True, "every_partition": True, "full_every": 0}}, "c.yaml")
    with pytest.raises(ConfigError, match="publish.full_every is set but publish.enabled is false"):
        config_from_dict({**base, "publish": {"full_every": 3}}, "c.yaml")
    with pytest.raises(ConfigError, match="publish.overwrite is set but publish.enabled is false"):
        config_from_dict({**base, "publish": {"overwrite": True}}, "c.yaml")
    assert default.publish.overwrite is False
