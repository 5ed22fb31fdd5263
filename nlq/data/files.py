"""Local text sources: .txt, .jsonl and .parquet files, a folder of them, or a glob.

Text must be Unicode: bytes that are not UTF-8, or a JSON escape of half a surrogate pair
("\\ud800"), are an NlqError naming the file (and line or byte), never replaced, so the shards
hold exactly the text given. Folders and globs follow symlinked folders, but each real folder
is read once for each part of the pattern (a symlink loop ends there), and a file reached by
several paths is one document (files are de-duplicated by their resolved path).
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from nlq.errors import NlqError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
SPEC_HELP = ("embedded, embedded:kjv, embedded:all, embedded:sotu, embedded:wiki, "
             "embedded:shakespeare-extra, embedded:prose, hf:NAME[:CONFIG], or a "
             ".txt/.jsonl/.parquet file, folder or glob")


def decode_text(data: bytes, path: Path | str, where: str = "") -> str:
    """UTF-8 text or an error naming the file: NUL bytes mean a binary file given as text."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise NlqError(f"{path}{where} looks like a binary file, not text (NUL byte at offset "
                       f"{nul}); give UTF-8 .txt, .jsonl or .parquet files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NlqError(f"{path}{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                       f"{e.start}); convert it to UTF-8") from None


def read_txt(path: Path) -> list[str]:
    return [decode_text(path.read_bytes(), path)]


def read_jsonl(path: Path, field: str) -> list[str]:
    docs = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            line = decode_text(raw, path, f" line {i}")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise NlqError(f"{path} line {i} is not valid JSON: {e.msg}") from None
            if not isinstance(obj, dict) or field not in obj:
                raise NlqError(f"{path} line {i} has no {field!r} field "
                               f"(choose the field with --text-field)")
            text = obj[field]
            if not isinstance(text, str):
                raise NlqError(f"{path} line {i}: field {field!r} is "
                               f"{type(text).__name__}, not a string")
            if b"\\u" in raw:  # only a \uXXXX escape can make half a surrogate pair
                _check_unicode(text, f"{path} line {i}")
            docs.append(text)
    return docs


def _check_unicode(text: str, where: str) -> None:
    """Valid JSON can still hold text that is not Unicode: an escaped lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise NlqError(f"{where} holds an unpaired surrogate \\u{ord(text[e.start]):04x} (at "
                       f"character {e.start}), which is not Unicode text: fix or drop it") from None


def read_parquet(path: Path, field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise NlqError(f"{path} is not a readable parquet file: {e}") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise NlqError(f"{path} has no column {field!r} (columns: {', '.join(names)}; choose "
                       f"one with --text-field)")
    col = pf.read(columns=[field]).column(field)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise NlqError(f"{path}: column {field!r} has type {col.type}, not string")
    try:
        return [d for d in col.to_pylist() if d is not None]
    except UnicodeDecodeError as e:  # parquet does not check that its strings are UTF-8
        raise NlqError(f"{path}: column {field!r} holds bytes that are not UTF-8 ({e.reason}); "
                       f"convert it to UTF-8") from None


def _is_magic(part: str) -> bool:
    return any(c in part for c in "*?[")


def _folder_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the folder at path, through symlinks; None if it is not one."""
    try:
        st = os.stat(path)
    except OSError:  # gone, a broken link, a loop of links
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _glob(folder: Path, parts: tuple[str, ...], hidden: bool, seen: set) -> Iterator[Path]:
    """Paths under folder matching the glob segments parts ("**": any number of folders;
    names starting with "." only where hidden or the segment starts with "."). A real folder
    is searched for the same segments once: a symlink loop ends there, unlike glob.glob."""
    key = (_folder_id(folder), parts)
    if key[0] is None or key in seen:
        return
    seen.add(key)
    head, rest = parts[0], parts[1:]
    if head == "**" and rest:
        yield from _glob(folder, rest, hidden, seen)  # "**" as no folder at all
    try:
        with os.scandir(folder) as it:
            names = sorted(e.name for e in it)
    except OSError:  # unreadable: skipped, as glob.glob does
        return
    for name in names:
        if name.startswith(".") and not (hidden or head.startswith(".")):
            continue
        if head == "**":
            if not rest:
                yield folder / name
            yield from _glob(folder / name, parts, hidden, seen)
        elif fnmatch.fnmatchcase(name, head) and rest:
            yield from _glob(folder / name, rest, hidden, seen)
        elif fnmatch.fnmatchcase(name, head):
            yield folder / name


def _files(root: Path, parts: tuple[str, ...], hidden: bool) -> list[Path]:
    """The files that match, sorted, each real file once (the first path that reaches it)."""
    files, seen = [], set()
    for f in sorted(p for p in _glob(root, parts, hidden, set()) if p.is_file()):
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            files.append(f)
    return files


def local_files(spec: str) -> list[Path]:
    p = Path(spec)
    if _is_magic(spec):
        parts = p.parts
        i = next(i for i, part in enumerate(parts) if _is_magic(part))
        files = _files(Path(*parts[:i]) if i else Path("."), parts[i:], hidden=False)
        if not files:
            raise NlqError(f"source {spec!r}: the glob matches no files")
    elif p.is_dir():
        # every file below, hidden ones too (as Path.rglob("*") has always read them)
        files = [f for f in _files(p, ("**", "*"), hidden=True) if f.suffix in LOCAL_SUFFIXES]
        if not files:
            raise NlqError(f"source folder {p} holds no .txt, .jsonl or .parquet files")
        return files
    elif p.is_file():
        files = [p]
    else:
        raise NlqError(f"source not found: {spec!r} (expected {SPEC_HELP})")
    for f in files:
        if f.suffix not in LOCAL_SUFFIXES:
            raise NlqError(f"{f}: unsupported file type {f.suffix or '(none)'!r} "
                           f"(use .txt, .jsonl or .parquet)")
    return files
