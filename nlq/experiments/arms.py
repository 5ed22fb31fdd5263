"""Arms: named overrides of a base config, as written in presets and experiment files.

An arm is a table of dotted config keys (`model.query = "nonlinear"`) plus two computed
keys: `grow_non_embedding_pct = P` sets model.mlp_hidden to the width that adds P% of
non-embedding parameters (the paper's "+12.5%" baseline), and `lr_scale = s` multiplies
train.lr and train.min_lr (the paper also ran that arm at lr / sqrt(1.125)).
"""

from __future__ import annotations

from typing import Any

from nlq.config import Config, apply_overrides, from_dict, load_config, preset_path, read_toml, split_arms
from nlq.errors import NlqError
from nlq.model.params import mlp_width_for_pct

COMPUTED = ("grow_non_embedding_pct", "lr_scale")


def resolve_arm(base: Config, arm: dict[str, Any], name: str = "arm") -> Config:
    plain = {k: v for k, v in arm.items() if k not in COMPUTED}
    for k in plain:
        if "." not in k:
            raise NlqError(
                f"arm {name!r}: unknown key {k!r} (use section.key overrides or one of "
                f"{', '.join(COMPUTED)})"
            )
    cfg = from_dict(apply_overrides(base.to_dict(), plain))
    extra: dict[str, Any] = {}
    if "grow_non_embedding_pct" in arm:
        pct = arm["grow_non_embedding_pct"]
        if not isinstance(pct, (int, float)) or isinstance(pct, bool):
            raise NlqError(f"arm {name!r}: grow_non_embedding_pct must be a number, got {pct!r}")
        extra["model.mlp_hidden"] = mlp_width_for_pct(cfg.model, float(pct))
    if "lr_scale" in arm:
        s = arm["lr_scale"]
        if not isinstance(s, (int, float)) or isinstance(s, bool) or s <= 0:
            raise NlqError(f"arm {name!r}: lr_scale must be a positive number, got {s!r}")
        extra["train.lr"] = cfg.train.lr * s
        extra["train.min_lr"] = cfg.train.min_lr * s
    return cfg.replace(**extra) if extra else cfg


def preset_arms(preset: str, sets: dict[str, Any] | None = None) -> dict[str, Config]:
    """The arms of a preset, each resolved against the preset (plus --set overrides)."""
    base = load_config(preset, sets)
    _, arms = split_arms(read_toml(preset_path(preset)))
    return {name: resolve_arm(base, arm, name) for name, arm in arms.items()}
