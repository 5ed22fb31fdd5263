"""The `nlq` command (also `python -m nlq`). Each subcommand lives beside the code it drives
(nlq/<package>/cli.py exposes COMMANDS = {name: (help, add_arguments, run)}).

An NlqError is printed as one line `nlq: error: ...` with exit status 2, and so is an OSError
that nothing more specific caught (a full disk, a read-only path), and an exception raised by
the code of an --import; --debug shows the traceback instead. An over-long value or path in the
line is cut (nlq.errors.cut_long). An NlqError with its own exit_code (a command stopped by a
signal: 128 + the signal) is printed as `nlq: ...` and exits with that code.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from nlq import __version__
from nlq.errors import NlqError, cut_long, os_error_text

# Packages whose cli module contributes subcommands, in the order `nlq --help` lists them.
COMMAND_MODULES = ["nlq.data.cli", "nlq.train.cli", "nlq.experiments.cli", "nlq.infer.cli",
                   "nlq.config.cli"]


class Parser(argparse.ArgumentParser):
    """argparse's answer to a bad flag or value in nlq's one form: its usage, then
    `nlq: error: COMMAND: ...` (a subcommand's parser would say `nlq COMMAND: error:`)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        command = self.prog.removeprefix("nlq").strip()
        self.exit(2, f"nlq: error: {command + ': ' if command else ''}{message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="nlq", description="Nonlinear-query attention: models, data, training, reports."
    )
    parser.add_argument("--version", action="version", version=f"nlq {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks on errors (also of the code an --import runs)")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE|FILE.py",
                        help="import this first (e.g. a module that calls "
                             "nlq.model.query.register_query); runs started by this command "
                             "import it too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for modname in COMMAND_MODULES:
        mod = importlib.import_module(modname)
        for name, (help_, add_arguments, run) in mod.COMMANDS.items():
            p = sub.add_parser(name, help=help_, description=help_)
            # SUPPRESS: without --debug here, `nlq --debug COMMAND` keeps the top-level value
            # (a subparser default of False would overwrite it)
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                           help="show tracebacks on errors")
            add_arguments(p)
            p.set_defaults(_run=run)
    return parser


IMPORT_ENV = "NLQ_IMPORT"  # how --import reaches the `nlq train` processes a command starts


def import_user_modules(names: list[str]) -> None:
    """Import each module name or .py file, then record them all in NLQ_IMPORT (absolute
    paths for files) so that child processes import them as well."""
    import os
    from pathlib import Path

    inherited = [n for n in os.environ.get(IMPORT_ENV, "").split(os.pathsep) if n]
    done: list[str] = []
    for name in dict.fromkeys(inherited + [str(Path(n).resolve()) if n.endswith(".py") else n
                                           for n in names]):
        if name.endswith(".py"):
            path = Path(name).resolve()
            if not path.is_file():
                raise NlqError(f"--import {name}: no such file")
            spec = importlib.util.spec_from_file_location(f"nlq_user_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            try:
                spec.loader.exec_module(mod)
            except Exception as e:  # the user's code: its error, not nlq's (--debug: where)
                del sys.modules[spec.name]
                raise NlqError(f"--import {name} failed: {_one_line(e)}") from e
        else:
            try:
                importlib.import_module(name)
            except Exception as e:
                raise NlqError(f"--import {name} failed: {_one_line(e)}") from e
        if name not in done:
            done.append(name)
    if done:
        os.environ[IMPORT_ENV] = os.pathsep.join(done)


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:  # building the parser imports every command's module: a second or so
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("nlq: interrupted", file=sys.stderr)
        return 130
    try:
        import_user_modules(args.imports)
        return int(args._run(args) or 0)
    except NlqError as e:
        if args.debug:
            raise
        code = getattr(e, "exit_code", 2)  # e.g. 128 + the signal that stopped a command
        print(f"nlq: {'error: ' if code == 2 else ''}{cut_long(str(e))}", file=sys.stderr)
        return code
    except OSError as e:  # a full disk, a read-only or missing path that no handler named
        if args.debug:
            raise
        print(f"nlq: error: {cut_long(os_error_text(e))}, then run the command again "
              f"(--debug shows where it happened)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nlq: interrupted", file=sys.stderr)
        return 130
