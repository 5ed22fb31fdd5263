"""Arms: named overrides of a base config. Each is written once, in arms.toml beside this
file; an experiment lists the arms it runs by name (or, as OUT/experiment.toml does, writes
their recipes out in full).

An arm is a table of dotted config keys (`model.query = "nonlinear"`) plus two computed
keys: `grow_non_embedding_pct = P` sets model.mlp_hidden to the width that adds P% of
non-embedding parameters (the paper's "+12.5%" baseline), and `lr_scale = s` multiplies
train.lr and train.min_lr (the paper also ran that arm at lr / sqrt(1.125); docs/paper.md,
"The other arms").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nlq.config import Config, apply_overrides, flatten, from_dict, read_toml
from nlq.errors import NlqError
from nlq.model.params import mlp_width_for_pct

ARMS_FILE = Path(__file__).with_name("arms.toml")
COMPUTED = ("grow_non_embedding_pct", "lr_scale")


def recipe(raw: Any, name: str) -> dict[str, Any]:
    """An arm's table as flat dotted keys (its values are checked by resolve_arm)."""
    if not isinstance(raw, dict):
        raise NlqError(f"arm {name!r} must be a table of config overrides, got {raw!r}")
    return flatten(raw)


def named_arms() -> dict[str, dict[str, Any]]:
    """Every arm of arms.toml: name -> recipe, in file order."""
    return {name: recipe(raw, name) for name, raw in read_toml(ARMS_FILE).items()}


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
