"""Frozen config dataclasses, read from TOML with tomllib (never executed).

- schema.py: the sections with a docstring per key ([model] is the model's own ModelConfig,
  nlq/model/config.py; [train], [data]), Config, and building a Config from plain data;
- validate.py: the checks ([train], [data], across sections; the model checks its own);
- load.py: TOML files, presets and `--set` overrides;
- cli.py: `nlq config`, which prints a resolved config or every key's docstring.
Unknown keys, wrong types and impossible values raise NlqError naming the key.
"""

from nlq.config.load import (
    PRESET_DIR,
    config_from_toml,
    flatten,
    load_config,
    parse_sets,
    parse_value,
    preset_path,
    read_toml,
)
from nlq.config.schema import (
    SECTIONS,
    Config,
    DataConfig,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    from_dict,
    model_config_from_dict,
)
from nlq.config.validate import objective, validate, validate_model

__all__ = [
    "PRESET_DIR",
    "SECTIONS",
    "Config",
    "DataConfig",
    "ModelConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_toml",
    "flatten",
    "from_dict",
    "load_config",
    "model_config_from_dict",
    "objective",
    "parse_sets",
    "parse_value",
    "preset_path",
    "read_toml",
    "validate",
    "validate_model",
]
