"""Config values that are TOML tables (model.query_args): flat {name: scalar}, read-only.

A frozen dataclass holding a plain dict would be neither frozen nor hashable; Table is a
dict that refuses changes and hashes by content, and that json and tomli_w write as the
plain table it is. This module imports nothing else of nlq but the error type.
"""

from __future__ import annotations

from typing import Any

from nlq.errors import NlqError

SCALARS = (bool, int, float, str)


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
