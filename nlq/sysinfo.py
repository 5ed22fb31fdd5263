"""What a result was measured on, for reports, run summaries and benchmark records."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from nlq.errors import NlqError


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The instruction set torch's CPU kernels dispatch to here (AVX512, AVX2, DEFAULT...):
    kernels of different widths sum floats in different orders."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # an old torch
        return "unknown"


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, as taskset or a container sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(n: object, what: str) -> int:
    """n as a thread count for this machine: an integer from 1 to its cores, else an error
    naming `what` (a flag or config key)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise NlqError(f"{what} must be a whole number of threads, got {n!r}")
    if n < 1:
        raise NlqError(f"{what} must be >= 1, got {n}")
    if n > cores():
        raise NlqError(f"{what} = {n} is more threads than this machine's {cores()} cores")
    return n


def machine_record() -> dict:
    """What summed a run's floats: CPU, its ISA path and the intra-op threads now set."""
    import torch

    return {"cpu": cpu_name(), "isa": cpu_isa(), "threads": torch.get_num_threads()}
