"""The loop's console side: a progress bar on rank 0, and SIGINT / SIGTERM turned into a clean
stop at the next step boundary."""

from __future__ import annotations

import contextlib
import signal
import sys
import types

from nlq.progress import bar_interval


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
               unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=bar_interval())
    try:
        yield bar
    finally:
        bar.close()



# dense bf16 peaks (TFLOP/s) of GPUs nlq is run on, for the MFU of a plain log line
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
                   "4090": 165.0}


def peak_memory_mb(device) -> float:
    """Peak memory of this process so far: CUDA allocations on a GPU, else the resident set."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class PlainLog:
    """What a run prints without a progress bar (not a terminal, `--no-progress`, inside
    `nlq reproduce`): about 50 lines a run on stdout (errors and warnings keep stderr), each `step, loss, lr, grad norm, tok/s, [MFU],
    ETA, peak memory`, so a log file shows a live run's state."""

    def __init__(self, max_steps: int, step: int, flops_per_token: float, device):
        import time

        import torch

        self.max_steps, self.every = max_steps, max(1, max_steps // 50)
        self.next = (step // self.every + 1) * self.every
        self.t0, self.step0 = time.perf_counter(), step
        self.flops = flops_per_token
        self.peak = None
        if getattr(device, "type", "cpu") == "cuda":
            name = torch.cuda.get_device_name(device)
            self.peak = next((v * 1e12 for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)

    def maybe_print(self, rec: dict) -> None:
        import time

        step = rec["step"]
        if step < self.next and step != self.max_steps:
            return
        self.next = (step // self.every + 1) * self.every
        done = step - self.step0
        left = (time.perf_counter() - self.t0) / max(done, 1) * (self.max_steps - step)
        mfu = (f", MFU {rec['tok_per_s'] * self.flops / self.peak:.1%}"
               if self.peak else "")
        print(f"step {step}/{self.max_steps}: loss {rec['loss']:.4f}, lr {rec['lr']:.3g}, "
              f"grad norm {rec['grad_norm']:.3f}, {rec['tok_per_s']:,.0f} tok/s{mfu}, "
              f"ETA {left / 60:.1f} min, peak mem {rec['peak_mem_mb']:,.0f} MB", flush=True)
