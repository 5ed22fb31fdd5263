"""Loading configs: TOML files, presets (nlq/presets/*.toml) and `--set` overrides.

`load_config` resolves a source (a TOML file, a preset name, or nothing: the defaults), the
file's base preset if it names one, then the overrides, and builds the validated Config
through nlq/config/schema.py. TOML is parsed with tomllib, never executed.

The top-level key `preset = NAME` of a config file names its base: NAME is one of the
presets shipped in nlq/presets/ (tiny, small, gpt3-small), never a path, so a config cannot
pull in another file from the disk (`preset = "../x"` or an absolute path is an error naming
the key). The file's own sections then override the preset's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from nlq.config.schema import Config, apply_overrides, from_dict
from nlq.errors import NlqError, os_error_text, short

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_DIR = Path(__file__).parents[1] / "presets"
# Levels of tables and arrays inside each other that a TOML file may have. A config needs 3
# (the file, [section], a table value such as [model.query_args]); an experiment file a few
# more. Far deeper nesting is no config, and parsing it exhausts Python's recursion limit.
MAX_DEPTH = 32


def _depth(value: Any) -> int:
    """Levels of dicts and lists inside each other, counted without recursion."""
    depth, level = 0, [value]
    while level:
        level = [v for x in level if isinstance(x, (dict, list))
                 for v in (x.values() if isinstance(x, dict) else x)]
        depth += 1
    return depth - 1


def _parse(text: str, what: str) -> dict:
    """tomllib.loads(text): TOMLDecodeError for text that is no TOML, an NlqError naming
    `what` for nesting or integers beyond what Python parses."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise
    except RecursionError:
        raw = None
    except ValueError:  # int() refuses integers of more than 4300 digits
        m = re.search(r"[0-9_]{4301,}", text)
        line = (f" (at line {text.count(chr(10), 0, m.start()) + 1})"
                if m and "\n" in text.strip() else "")
        raise NlqError(f"{what} is not valid TOML: an integer of more than 4300 digits"
                       f"{line}") from None
    if raw is None or _depth(raw) > MAX_DEPTH:
        raise NlqError(f"{what}: nested too deeply (tables or arrays more than {MAX_DEPTH} "
                       f"levels inside each other)")
    return raw


def loads(text: str, what: str) -> dict:
    """tomllib.loads(text); every way it fails is an NlqError naming `what` (a file) and,
    where it can be told, the line."""
    try:
        return _parse(text, what)
    except tomllib.TOMLDecodeError as e:
        raise NlqError(f"{what} is not valid TOML: {e}") from None


def parse_value(text: str, key: str = "") -> Any:
    """A --set value is a TOML value (3e-4, true, "x", 12); a bare word is a string."""
    try:
        return _parse(f"v = {text}", f"the value of --set {short(key)}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise NlqError(f"--set expects section.key=value, got {short(item)}")
        out[key.strip()] = parse_value(value.strip(), key.strip())
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
    except OSError as e:  # a name too long, no permission
        raise NlqError(f"cannot read config file: {os_error_text(e)}") from None
    return loads(text, f"config file {path}")


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:  # a name too long to be a file: then it is no preset either
        return False


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def preset_names() -> list[str]:
    return sorted(x.stem for x in PRESET_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    """The file of a shipped preset. Only the names in nlq/presets/ are presets: a name with
    a / or .. in it is no preset (it would reach any .toml on the disk)."""
    names = preset_names()
    if name not in names:
        raise NlqError(f"unknown preset {short(name)} (presets: {', '.join(names)})")
    return PRESET_DIR / f"{name}.toml"


def load_config(source: str | Path | None = None, sets: dict[str, Any] | None = None) -> Config:
    """source: a TOML file, a preset name, or None (the defaults). A file may name a base
    preset with `preset = "tiny"` at its top, a name of nlq/presets/ (never a path); its own
    sections then override the preset."""
    if source is None:
        raw: dict = {}
    elif Path(source).suffix == ".toml" or _is_file(Path(source)):
        # is_file, not exists: a folder named like a preset (e.g. `--out tiny`) is no config
        raw = read_toml(source)
    elif _is_dir(Path(source)) and str(source) not in preset_names():
        raise NlqError(f"config path {source} is a directory, expected a TOML file or a preset "
                       f"name")
    else:
        raw = read_toml(preset_path(str(source)))
    base = raw.pop("preset", None)
    if base is not None:
        if not isinstance(base, str) or base not in preset_names():
            raise NlqError(f"config key 'preset' = {short(base)} in {source} is not a preset "
                           f"name (presets: {', '.join(preset_names())}; `preset` names one "
                           f"of nlq/presets/, never a file)")
        base_raw = read_toml(preset_path(base))
        base_raw.pop("preset", None)
        raw = apply_overrides(base_raw, flatten(raw))
    return from_dict(apply_overrides(raw, sets or {}))


def config_from_toml(text: str, what: str = "config") -> Config:
    """The Config of a TOML text (e.g. a run dir's config.toml); what names it in errors."""
    return from_dict(loads(text, what))
