"""What type checkers see of ``recsys_dist.config`` (its lazy names with their real types)."""

from recsys_dist.config.base import ConfigError as ConfigError
from recsys_dist.config.base import Section as Section
from recsys_dist.config.loader import config_from_dict as config_from_dict
from recsys_dist.config.loader import load_config as load_config
from recsys_dist.config.loader import parse_overrides as parse_overrides
from recsys_dist.config.loader import save_config as save_config
from recsys_dist.config.run import RunConfig as RunConfig

__all__: list[str]
