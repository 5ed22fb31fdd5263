"""How often a tqdm bar redraws, shared by every long command (train, study, prepare)."""

from __future__ import annotations

import sys


def bar_interval(stream=None) -> float:
    """Seconds between a tqdm bar's refreshes (its mininterval): tqdm's 0.1 on a terminal; 30
    when the stream is a file or pipe (a study under nohup for days), where every refresh is
    another line kept: a 3-hour study log was 1.2 MB of bars at 0.1."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return 0.1 if isatty is not None and isatty() else 30.0
