"""The run configuration: one frozen dataclass per TOML section whose fields are the keys
(their docstrings the help), read from TOML plus ``--section.key=value`` overrides and
checked. Resolution into what a run executes is meshforge/resolve.py's."""

from meshforge.config.keys import SECTIONS, Key, keys
from meshforge.config.load import build, key_type, load_config, to_dict, to_toml
from meshforge.config.sections import Config
from meshforge.config.values import parse_value

__all__ = [
    "SECTIONS",
    "Config",
    "Key",
    "build",
    "key_type",
    "keys",
    "load_config",
    "parse_value",
    "to_dict",
    "to_toml",
]
