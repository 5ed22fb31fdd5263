"""Typed values from plain data: the checks every config dataclass shares.

A section of settings (the model's ModelConfig in nlq/model/config.py, the run's [train]
and [data] in nlq/config/schema.py) is a frozen dataclass built from a TOML table. Every key
must be a field, every value of its field's type, every integer within its range; an error
is an NlqError naming `section.key` and the value. A field that is itself a table of
settings (model.query_args) holds a Table: read-only and hashable, so the config stays
frozen. This module imports nothing of nlq but the error type.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

from nlq.errors import NlqError, short

SCALARS = (bool, int, float, str)
# Sizes stay below 2^31: a tensor dimension, and far beyond any memory long before that
# (nlq/run/memory.py refuses what does not fit this machine). Any other integer key must
# fit in 64 bits, what a TOML integer holds.
SIZE = (1, 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


class Table(dict):
    """A read-only dict of scalars, hashable by content (a config field's value)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _read_only(self, *args, **kwargs):
        raise TypeError("a config table is read-only: build another config "
                        "(Config.replace, dataclasses.replace)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _read_only
    __ior__ = _read_only

    def __reduce__(self):  # pickle / copy rebuild it from a plain dict, not item by item
        return (type(self), (dict(self),))


def check_table(key: str, value: Any) -> Table:
    """value as a Table, or an NlqError naming `key` (or `key.name` for a bad entry)."""
    if not isinstance(value, dict):
        raise NlqError(f"config key '{key}' must be a table of name = value settings, got "
                       f"{value!r}")
    for name, v in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise NlqError(f"config key '{key}' has a setting named {name!r}: names must be "
                           f"Python identifiers (they become keyword arguments)")
        if not isinstance(v, SCALARS):
            raise NlqError(f"config key '{key}.{name}' must be a bool, int, float or string, "
                           f"got {v!r} ({type(v).__name__})")
    return Table(value)


def check_type(key: str, value: Any, tp: Any) -> Any:
    """Return value converted to tp (int -> float only), or raise naming key."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return check_type(key, value, args[0])
    if origin is dict:  # a TOML table of settings (model.query_args)
        return check_table(key, value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a field type we do not support is a programming error
        raise TypeError(f"unsupported config type {tp} for {key}")
    name = getattr(tp, "__name__", str(tp))
    raise NlqError(f"config key '{key}' must be {name}, got {short(value)} "
                   f"({type(value).__name__})")


def build_section(name: str, cls: type, raw: dict) -> Any:
    """cls(**raw) with every key known and every value of its field's type (section [name])."""
    if not isinstance(raw, dict):
        raise NlqError(f"config key '{name}' must be a table, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise NlqError(
            f"unknown config key '{name}.{unknown[0]}' (known keys of [{name}]: "
            f"{', '.join(sorted(known))})"
        )
    kw = {k: check_type(f"{name}.{k}", v, hints[k]) for k, v in raw.items()}
    return cls(**kw)


@functools.cache
def _int_fields(cls: type) -> tuple[str, ...]:
    """The fields of a section whose type is int or int | None."""
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls)
                 if hints[f.name] is int or int in typing.get_args(hints[f.name]))


def check_ints(section: str, obj: Any, ranges: dict[str, tuple[int, int]]) -> None:
    """Every integer key of a section within its range (ranges[key]; 64 bits for the rest)."""
    for name in _int_fields(type(obj)):
        key, value = f"{section}.{name}", getattr(obj, name)
        lo, hi = ranges.get(key, INT64)
        if value is not None and not lo <= value <= hi:
            top = "2**31 - 1" if hi == SIZE[1] else "2**63 - 1" if hi == INT64[1] else hi
            raise NlqError(f"config key '{key}' must be an integer in [{lo}, {top}], got "
                           f"{short(value)}")


def choice(key: str, value: str, allowed) -> None:
    if value not in allowed:
        raise NlqError(f"config key '{key}' = {short(value)} is not one of {', '.join(allowed)}")


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise NlqError(f"config key '{key}' must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise NlqError(f"config key '{key}' must be {need}, got {value!r}")


def divisible(key: str, value: int, by_key: str, by: int) -> None:
    if value % by:
        raise NlqError(f"config key '{key}' = {value} is not divisible by {by_key} = {by}")
