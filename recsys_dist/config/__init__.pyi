"""What type checkers see of ``recsys_dist.config`` (its lazy names with their real types)."""

from recsys_dist.config.loader import config_from_dict as config_from_dict
from recsys_dist.config.loader import load_config as load_config
from recsys_dist.config.loader import parse_overrides as parse_overrides
from recsys_dist.config.loader import save_config as save_config
from recsys_dist.config.run import RunConfig as RunConfig
from recsys_dist.section import ConfigError as ConfigError
from recsys_dist.section import Section as Section

__all__: list[str]
