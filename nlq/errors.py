"""One error type for everything a user can get wrong.

The CLI prints an NlqError as a single line (no traceback unless --debug) and exits with
status 2, so every bad key, file or value is named and nothing else is printed. The helpers
below keep that line readable: short() echoes a value cut to a few dozen characters,
cut_long() bounds the printed line, os_error_text() gives advice that fits the errno.
"""


class NlqError(Exception):
    """A user-facing error: the message names the bad key, file or value and what to do."""


def short(value, n: int = 80) -> str:
    """repr(value) in about n characters at most, for echoing a user's value in a message: a
    5000-character path, a 400-digit integer or a list nested 3000 deep is cut, saying how
    long it was."""
    if isinstance(value, str):
        if len(value) <= n:
            return repr(value)
        head, tail = value[:n * 2 // 3], value[-(n // 6):]
        return f"{head + '...' + tail!r} ({len(value)} chars)"
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() <= 3 * n:  # repr of a huge int is slow (and refused > 4300 digits)
            return repr(value)
        return f"an integer of {value.bit_length()} bits"
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, n, n, n
    text = r.repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def cut_long(text: str, word: int = 240, line: int = 900) -> str:
    """text with every run of more than `word` non-blank characters (an over-long path or
    value that a message echoed) cut to its start and end, and then the whole cut to `line`
    characters the same way: what the CLI prints stays one line that a terminal shows."""
    import re

    def cut(s: str, n: int) -> str:
        return f"{s[:n * 2 // 3]}...[{len(s) - n} more chars]...{s[-(n // 3):]}"

    text = re.sub(rf"\S{{{word + 1},}}", lambda m: cut(m.group(0), word), text)
    return cut(text, line) if len(text) > line else text


def os_error_text(e: OSError) -> str:
    """What went wrong, the file (cut to a readable length) and what to do, by errno: free
    space for a full disk, a shorter path for a name too long, permissions otherwise."""
    import errno

    where = f" ({short(str(e.filename), 120)})" if e.filename else ""
    advice = {errno.ENOSPC: "free space", errno.EDQUOT: "free space (a disk quota is full)",
              errno.ENAMETOOLONG: "path too long: use a shorter path",
              errno.EROFS: "the file system is read-only: use another path",
              errno.EACCES: "fix the permissions", errno.EPERM: "fix the permissions",
              errno.ENOENT: "check the path", errno.ENOTDIR: "a part of the path is a file"}
    return f"{e.strerror or e}{where}: {advice.get(e.errno, 'check the path and free space')}"
