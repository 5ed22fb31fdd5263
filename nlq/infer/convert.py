"""The folder `nlq convert` writes: built whole under a temporary name beside it, then renamed
into place, with nlq_convert.json saying what it holds (the source, the checkpoint's step, the
format). That record is also how a later convert knows the folder is one it may replace: a
folder holding anything else is the user's (their own config.json or model.safetensors) and is
refused untouched, as `nlq train --out` refuses a folder that is not a run dir."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from nlq.errors import NlqError

RECORD = "nlq_convert.json"


def converted_step(folder: Path) -> int | None:
    """The training step a folder `nlq convert` wrote holds, None for any other folder."""
    try:
        step = json.loads((folder / RECORD).read_text()).get("step")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def check_out(out: Path) -> None:
    """Refuse an --out that is a file, a symbolic link, or a non-empty folder that convert did
    not write."""
    if out.is_symlink():
        raise NlqError(f"--out {out} is a symbolic link: nlq never writes through one; give "
                       f"a new folder")
    if out.exists() and not out.is_dir():
        raise NlqError(f"--out {out} is a file, not a folder; give a new folder")
    if out.is_dir() and not (out / RECORD).is_file():
        names = sorted(os.listdir(out))
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise NlqError(f"--out {out} is not empty and was not written by `nlq convert` "
                           f"(it holds {', '.join(names[:3])}{more}): give a new or empty "
                           f"folder")


def write(out: Path, fill: Callable[[Path], None], record: dict) -> None:
    """fill(folder) writes the files; then the folder, with its record, becomes `out` (an
    empty folder, or one an earlier convert wrote, is replaced whole: no stale file stays)."""
    check_out(out)
    tmp = out.parent / f".{out.name}.convert-tmp"
    old = out.parent / f".{out.name}.convert-old"
    for leftover in (tmp, old):  # of a convert that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
