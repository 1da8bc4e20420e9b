"""``data.config`` is a section config: validating a ``data`` section loads no format module
(pyarrow); the checks that need the format run from ``RunConfig`` (``data.resolve.check_data``)."""

import pytest

from recsys_dist.config.loader import config_from_dict
from recsys_dist.errors import ConfigError


def test_format_checks_run_from_the_run_config():
    with pytest.raises(ConfigError, match=r"\n  data: data\.num_embeddings: expected one int or a list of 26"):
        config_from_dict({"data": {"num_embeddings": [5, 6]}})
