"""`nlq config`: print a fully resolved config as TOML, or every key with its docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import tomli_w

from nlq.config.load import load_config, parse_sets
from nlq.config.schema import SECTIONS


def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of a dataclass, read from its source: the string literal under
    each annotated field (Python keeps no attribute docstrings at runtime). A field without
    one maps to ""."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # the class statement's body
    docs = {f.name: "" for f in dataclasses.fields(cls)}
    for stmt, nxt in zip(body, body[1:] + [None]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str) and stmt.target.id in docs):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _toml_value(value) -> str:
    if value is None:
        return "unset"  # TOML has no null: an unset Optional is an absent key
    if isinstance(value, dict):  # an inline table, e.g. {} for model.query_args
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value}).strip().removeprefix("v = ")


def doc_lines() -> list[str]:
    """One line per key: `section.key (type, default): docstring`."""
    lines = []
    for sec, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            tp = f.type if isinstance(f.type, str) else f.type.__name__
            doc = " ".join(docs[f.name].split())
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"{sec}.{f.name} ({tp}, {_toml_value(default)}): {doc}")
    return lines


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help="preset name or TOML file (default: the built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. model.query=nonlinear (repeatable)")
    p.add_argument("--doc", action="store_true",
                   help="print every key as `section.key (type, default): docstring` "
                        "(the defaults; CONFIG and --set are not read)")


def run(args) -> int:
    if args.doc:
        print("\n".join(doc_lines()))
        return 0
    print(load_config(args.config, parse_sets(args.set)).to_toml(), end="")
    return 0


COMMANDS = {"config": ("print a resolved config as TOML, or every key's docs (--doc)",
                       add_arguments, run)}
