"""Keep freed CPU memory in the process, so tensors rebuilt at every step are not faulted in
again.

A training step frees and re-allocates the same activation and gradient buffers (0.1-64 MiB)
every step. glibc malloc serves blocks above its mmap threshold (dynamic, 128 KiB to 32 MiB)
with fresh mmap()s and gives the top of the heap back to the OS beyond its trim threshold, so
those buffers come back as new pages that the kernel zeroes and faults in one 4 KiB page at a
time (~0.5 ms per MiB here). Fixing both thresholds (the usual glibc tuning for PyTorch on
CPU, like the jemalloc / tcmalloc advice) keeps the memory for reuse: about 7% faster steps
at the tiny benchmark shape in two back-to-back benchmark runs (benchmarks/RESULTS.md). The
process keeps up to its peak memory instead of returning it between steps, which is what a
training process wants anyway.

This is a setting of the whole process, so the library never applies it: `nlq train` calls
keep_freed_memory() on CPU before training (nlq/train/cli.py); code that calls
nlq.train.loop.train() or runs its own CPU loop calls it once itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; False where there is no glibc
    (macOS, musl, Windows), which then keeps its allocator's defaults."""
    global _done
    if _done is None:
        _done = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                         and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
