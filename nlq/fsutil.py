"""Durable file writes shared by data preparation and checkpoints: a reader sees the old file
or the new one, never a part (write a temp file, fsync, rename, fsync the folder)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path, strict: bool = True) -> None:
    """fsync a file, or a folder (so a rename in it is durable). strict=False ignores errors
    (cleanup paths, where a second error must not hide the first)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, strict: bool = True) -> None:
    """Replace path with text atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent, strict)
