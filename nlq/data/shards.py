"""Token shards on disk, written so that a crash never leaves a folder that looks complete.

Everything is written to *.tmp files and fsynced (ShardWriter); only then does commit remove
the old meta.json, rename the shards into place and write meta.json last (tmp + rename). An
interrupted run leaves no meta.json, so its folder never looks complete (TokenData.open
refuses it), and a run that fails on bad input touches nothing already prepared.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from nlq.fsutil import create, fsync, write_atomic


class ShardWriter:
    """Appends arrays to DIR/NAME.tmp, hashing as it goes."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.f = create(self.tmp)  # closed by close()
        self.sha, self.n = hashlib.sha256(), 0

    def write(self, arr: np.ndarray) -> None:
        b = arr.tobytes()
        self.f.write(b)
        self.sha.update(b)
        self.n += len(arr)

    def close(self) -> None:
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()


def write_json_atomic(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n", strict=False)


def commit(out: Path, writers: list[ShardWriter], tok_tmp: Path | None, meta: dict) -> None:
    """Move the finished .tmp files into place. The folder stops looking complete (no
    meta.json) before any file changes, and meta.json comes last."""
    (out / "meta.json").unlink(missing_ok=True)
    fsync(out, strict=False)
    for w in writers:
        os.replace(w.tmp, w.path)
    if tok_tmp is not None:
        os.replace(tok_tmp, out / "tokenizer.json")
    else:
        (out / "tokenizer.json").unlink(missing_ok=True)  # from an earlier bpe:N run
    fsync(out, strict=False)
    write_json_atomic(out / "meta.json", meta)
