"""Fault injection for the crash tests (tests/test_resume.py, tests/robustness/).

NLQ_FAULT="POINT@N" acts the N-th time (1-based) this process reaches POINT:
    step, eval, ckpt_model, ckpt_optim, ckpt_state, ckpt_rename, ckpt_latest -> SIGKILL itself
    nan                                                              -> the step's loss is NaN
Several specs may be joined with commas. Unset (always, outside tests) it costs one dict
lookup per call.
"""

from __future__ import annotations

import os
import signal

_seen: dict[str, int] = {}


def _armed() -> dict[str, int]:
    spec = os.environ.get("NLQ_FAULT", "")
    out = {}
    for part in filter(None, spec.split(",")):
        name, _, n = part.partition("@")
        out[name.strip()] = int(n or 1)
    return out


def hit(point: str) -> bool:
    """Count a visit to `point`; SIGKILL at an armed kill point; True at an armed 'nan'."""
    if "NLQ_FAULT" not in os.environ:
        return False
    _seen[point] = _seen.get(point, 0) + 1
    if _armed().get(point) != _seen[point]:
        return False
    if point == "nan":
        return True
    os.kill(os.getpid(), signal.SIGKILL)
    return False  # pragma: no cover
