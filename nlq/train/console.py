"""The loop's console side: a progress bar on rank 0, and SIGINT / SIGTERM turned into a clean
stop at the next step boundary."""

from __future__ import annotations

import contextlib
import signal
import sys
import types


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT / SIGTERM set .signum of the yielded flag (0: none yet): the loop finishes the
    current step, checkpoints at the boundary and exits cleanly. Handlers restored after."""
    flag = types.SimpleNamespace(signum=0)

    def on_signal(signum, _frame):
        flag.signum = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def progress_bar(run, step: int, progress: bool):
    """A tqdm bar on stderr from `step` (rank 0, when asked for), else None."""
    if not (run.world.main and progress):
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=run.cfg.train.max_steps, initial=step, desc=run.files.path.name,
               unit="step", dynamic_ncols=True, file=sys.stderr)
    try:
        yield bar
    finally:
        bar.close()

