"""Durable file writes shared by data preparation and checkpoints: a reader sees the old file
or the new one, never a part (write a temp file, fsync, rename, fsync the folder). Files are
created, never opened through a symlink, and a folder can be locked by one process."""

from __future__ import annotations

import contextlib
import fcntl
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


def create(path: Path, mode: str = "wb", **kw):
    """Open a new file at path for writing. Whatever is there (a temp file of a killed run,
    a planted symlink) is removed first and the new file is made with O_EXCL | O_NOFOLLOW,
    so a write never goes through a symlink into a file outside."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return os.fdopen(fd, mode, **kw)


def write_atomic(path: Path, text: str | bytes, strict: bool = True) -> None:
    """Replace path with text (or bytes) atomically: a reader sees the old file or the whole
    new one; a write that fails (a full disk) removes its temporary file and raises."""
    tmp = path.with_name(f".{path.name}.tmp")
    binary = isinstance(text, bytes)
    try:
        with create(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync(path.parent, strict)


class Locked(Exception):
    """lock() found the lock held; pid is what the holder wrote in the file ('?' if unknown)."""

    def __init__(self, pid: str):
        super().__init__(pid)
        self.pid = pid


# The descriptors of the locks this process holds. A forked child (a tokenizer worker, a
# DataLoader worker) would share each flock and keep it after this process dies (a worker
# orphaned by a SIGKILL), so children close them at once.
_held: set[int] = set()


def _close_held() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_held)


def lock(path: Path) -> int:
    """Take an exclusive flock on path (created if missing, never through a symlink) and write
    our pid in it. Returns the file descriptor: the lock lasts until it is closed (or the
    process dies, even by SIGKILL; forked children do not hold it). Raises Locked when another
    process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise Locked(pid) from None
        # unlock() removes the file: if the holder removed it while we opened it, our lock is
        # on a file no one else will see, so take it again on the file at path now
        try:
            st = os.stat(path, follow_symlinks=False)
            same = (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _held.add(fd)
            return fd
        os.close(fd)


def unlock(path: Path, fd: int) -> None:
    """Release a lock() and remove its file: removed while still held, so no process locks
    a file that is about to go."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    _held.discard(fd)
    os.close(fd)
