"""Config schemas (pydantic), YAML loading and dotted CLI overrides. Schemas only, no behaviour."""

from reroll.config.errors import ConfigError
from reroll.config.loading import load_config, parse_overrides
from reroll.config.schema import RLConfig, SFTConfig

__all__ = ["ConfigError", "RLConfig", "SFTConfig", "load_config", "parse_overrides"]
