"""Launchers: how the runs of an experiment are started, one interface chosen by name.

A launcher decides whether the next run fits beside the running ones and starts its
`nlq train` command as a child process. Everything above it is the same for every launcher
and written once (nlq/experiments/runner.py): which runs are finished, resumed or new, a
changed config refused, the queue, signals forwarded to the children, what failed.

- "local": child processes on this machine within a budget of CPU threads (jobs x the
  command's threads): a run at more threads (a numerical replicate) waits for room, because
  an oversubscribed core stalls a multi-threaded run's barriers many times over (measured:
  10x, docs/experiments.md); a run needing more than the budget runs alone.
- "gpus": --jobs runs per visible GPU at a time (default one), each child seeing only its
  own GPU (CUDA_VISIBLE_DEVICES), for a study on a machine of several GPUs.

- "slurm": each run a job submitted to a Slurm cluster through submitit, the cluster's
  settings from `--slurm FILE` (nlq/experiments/slurm.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import IO, Protocol

from nlq.errors import NlqError


class Proc(Protocol):
    """What the runner asks of a started run: a subprocess.Popen, or SubmititProc."""

    returncode: int | None

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass
class Job:
    """A started run: its child process, the file its output goes to, the slot it holds."""

    key: object  # the runner's handle for the run (its RunSpec)
    proc: Proc
    log: IO[str]
    threads: int
    slot: str | None = None  # the GPU it holds ("gpus")


class Launcher(Protocol):
    name: str

    def fits(self, running: list[Job], threads: int) -> bool:
        """Whether a run at `threads` CPU threads may start beside the running ones."""

    def start(self, key: object, cmd: list[str], log: IO[str], threads: int,
              running: list[Job]) -> Job:
        """Start `nlq CMD` (its output to log) and return its Job."""


def _spawn(cmd: list[str], log: IO[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nlq", *cmd, "--no-progress"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


@dataclass
class Local:
    """Child processes on this machine, within `budget` CPU threads; on a GPU machine they
    share its first GPU, `gpu_share` at a time (NLQ_GPU_SHARE: each run's memory check
    allows it that share of the card)."""

    budget: int
    gpu_share: int = 1
    name: str = "local"

    def fits(self, running: list[Job], threads: int) -> bool:
        return not running or sum(j.threads for j in running) + threads <= self.budget

    def start(self, key, cmd, log, threads, running) -> Job:
        # the run sets its own pool (train.threads); OpenMP outside torch's pool agrees
        env = {**os.environ, "OMP_NUM_THREADS": str(threads),
               "NLQ_GPU_SHARE": str(self.gpu_share)}
        return Job(key, _spawn(cmd, log, env), log, threads)


@dataclass
class Gpus:
    """per_device runs on each GPU of `devices` (the ids a child may be given as its
    CUDA_VISIBLE_DEVICES; default: every visible GPU)."""

    devices: list[str] = field(default_factory=list)
    per_device: int = 1
    name: str = "gpus"

    def __post_init__(self):
        if not self.devices:
            self.devices = visible_gpus()
        if not self.devices:
            raise NlqError("--launcher gpus: no CUDA GPU is visible here (use --launcher local)")

    def fits(self, running: list[Job], threads: int) -> bool:
        return len(running) < len(self.devices) * self.per_device

    def start(self, key, cmd, log, threads, running) -> Job:
        held = [j.slot for j in running]
        device = min(self.devices, key=held.count)  # the least busy GPU
        # NLQ_GPU_SHARE: the run's memory check allows it 1/per_device of the card
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": device,
               "NLQ_GPU_SHARE": str(self.per_device)}
        return Job(key, _spawn(cmd, log, env), log, threads, slot=device)


def visible_gpus() -> list[str]:
    """The GPU ids this process may hand out: CUDA_VISIBLE_DEVICES where set, else every
    device torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


LAUNCHERS = ("local", "gpus", "slurm")
# what --launcher (and --slurm) pass down to run_all: a launcher's name, or the settings of
# --launcher slurm (nlq/experiments/slurm_settings.py SlurmSettings)
LauncherSpec = object


def make_launcher(name: LauncherSpec, jobs: int, threads: int) -> Launcher:
    """The launcher `name` for a command of `jobs` runs at a time at `threads` threads each
    (slurm: its SlurmSettings, from --slurm FILE)."""
    if not isinstance(name, str):  # a launcher's settings (nlq/experiments/slurm_settings.py)
        return name.launcher(jobs)
    if name == "local":
        return Local(budget=jobs * threads, gpu_share=jobs)
    if name == "gpus":
        return Gpus(per_device=jobs)
    if name == "slurm":
        raise NlqError("--launcher slurm needs --slurm FILE: a TOML file whose [slurm] table "
                       "holds the cluster's settings (partition, timeout_min, ...)")
    raise NlqError(f"--launcher {name!r} is not one of {', '.join(LAUNCHERS)}")
