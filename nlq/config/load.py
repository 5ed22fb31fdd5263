"""Loading configs: TOML files, presets (nlq/presets/*.toml) and `--set` overrides.

`load_config` resolves a source (a TOML file, a preset name, or nothing: the defaults), the
file's base preset if it names one, then the overrides, and builds the validated Config
through nlq/config/schema.py. TOML is parsed with tomllib, never executed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from nlq.config.schema import Config, apply_overrides, from_dict
from nlq.errors import NlqError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_DIR = Path(__file__).parents[1] / "presets"


def parse_value(text: str) -> Any:
    """A --set value is a TOML value (3e-4, true, "x", 12); a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise NlqError(f"--set expects section.key=value, got {item!r}")
        out[key.strip()] = parse_value(value.strip())
    return out


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NlqError(f"config file not found: {path}") from None
    except UnicodeDecodeError:
        raise NlqError(f"config file {path} is not UTF-8 text") from None
    except IsADirectoryError:
        raise NlqError(f"config path {path} is a directory, expected a TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise NlqError(f"config file {path} is not valid TOML: {e}") from None


def preset_path(name: str) -> Path:
    p = PRESET_DIR / f"{name}.toml"
    if not p.is_file():
        names = sorted(x.stem for x in PRESET_DIR.glob("*.toml"))
        raise NlqError(f"unknown preset {name!r} (presets: {', '.join(names)})")
    return p


def load_config(source: str | Path | None = None, sets: dict[str, Any] | None = None) -> Config:
    """source: a TOML file, a preset name, or None (the defaults). A file may name a base
    preset with `preset = "tiny"` at its top; its own sections then override the preset."""
    if source is None:
        raw: dict = {}
    elif Path(source).suffix == ".toml" or Path(source).is_file():
        # is_file, not exists: a folder named like a preset (e.g. `--out tiny`) is no config
        raw = read_toml(source)
    elif Path(source).is_dir() and not (PRESET_DIR / f"{source}.toml").is_file():
        raise NlqError(f"config path {source} is a directory, expected a TOML file or a preset "
                       f"name")
    else:
        raw = read_toml(preset_path(str(source)))
    base = raw.pop("preset", None)
    if base is not None:
        if not isinstance(base, str):
            raise NlqError(f"config key 'preset' must be a preset name, got {base!r}")
        base_raw = read_toml(preset_path(base))
        base_raw.pop("preset", None)
        raw = apply_overrides(base_raw, flatten(raw))
    return from_dict(apply_overrides(raw, sets or {}))


def config_from_toml(text: str) -> Config:
    try:
        return from_dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e:
        raise NlqError(f"config is not valid TOML: {e}") from None
