"""The output folder of `nlq prepare` (DIR): whether it is ours to write into, the lock that
keeps a second prepare out, what a killed run leaves there, and whether a finished output can
be reused as it is.

DIR must be new, empty or an nlq data dir: a folder of other files is refused (its train.bin
would be someone else's). A finished output made with the same arguments is reused; one
made with other arguments is not overwritten without --force.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from nlq.data.schedule import TokenData
from nlq.data.split import PARTS
from nlq.errors import NlqError
from nlq.fsutil import Locked, lock

# The arguments that determine the output: a finished folder with other values is not redone
# (or overwritten) without --force.
ARG_KEYS = ("source", "tokenizer", "val_fraction", "test_fraction", "seed", "text_field")
LOCK = ".nlq-prepare.lock"
# what a run killed outright leaves in DIR (with the lock file); the next run removes them
TMP_NAMES = (*(f"{name}.bin.tmp" for name in PARTS), "tokenizer.json.tmp", ".meta.json.tmp")


def check_ours(out: Path) -> None:
    """Refuse a folder of other files: its train.bin or tokenizer.json would be replaced.
    nlq's own are empty, hold a data dir's meta.json, or hold the lock file (a prepare runs
    there, or was killed there)."""
    names = {p.name for p in out.iterdir()}
    if not names or LOCK in names:
        return
    with contextlib.suppress(OSError, ValueError):  # ValueError: not JSON, not UTF-8
        meta = json.loads((out / "meta.json").read_text())
        if isinstance(meta, dict) and {"tokenizer", "vocab_size", "dtype"} <= meta.keys():
            return
    raise NlqError(f"--out {out} holds other files and is not an nlq data dir (no meta.json "
                   f"from nlq prepare): nothing was written; choose a new or empty folder")


def lock_out(out: Path) -> int:
    """Take DIR's lock file (fsutil.unlock(out / LOCK, held) frees it), or refuse at once."""
    try:
        return lock(out / LOCK)
    except Locked as e:
        raise NlqError(f"{out} is being written by another nlq prepare (pid {e.pid}); wait for "
                       f"it to finish or choose another --out") from None


def existing(out: Path, args: dict) -> dict | None:
    """meta of a finished output made with the same args; None if there is nothing finished
    there; an error if it was made with other args (nothing is overwritten without --force)."""
    meta_path = out / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NlqError(f"{meta_path} exists but is not valid JSON: not overwriting it (use "
                       f"--force or another --out)") from None
    diff = [k for k in ARG_KEYS if meta.get(k) != args[k]]
    if diff:
        was = ", ".join(f"{k} {meta.get(k)!r} (now {args[k]!r})" for k in diff)
        raise NlqError(f"{out} was prepared with other arguments: {was}; use --force to "
                       f"replace it or choose another --out")
    try:
        TokenData.open(out)
    except NlqError:
        return None  # same args but damaged shards: redo them
    want = meta.get("tokenizer_sha256")
    if want is not None:  # a trained tokenizer edited or replaced since: its ids mean other text
        tj = out / "tokenizer.json"
        if not tj.is_file() or hashlib.sha256(tj.read_bytes()).hexdigest() != want:
            return None  # redo it: the preparation is deterministic
    return meta
