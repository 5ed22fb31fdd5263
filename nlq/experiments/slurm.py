"""--launcher slurm: each run of an experiment a job submitted to a Slurm cluster through
submitit (nlq/experiments/launch.py has the interface and the other launchers).

`--slurm FILE` is a TOML file whose [slurm] table holds the cluster's settings, every key
checked (nlq/experiments/slurm_settings.py); --jobs of the runs are submitted at once and the
scheduler decides where and when they run. `executor = "local"` runs the same jobs through
submitit's local executor instead (for tests, and to try a table on a laptop). Each job runs
`nlq train` as its child (TrainRun), so the bookkeeping of nlq/experiments/plan.py and
runner.py is the same as for the other launchers: skip finished runs, resume killed ones,
refuse a changed config, failures.json.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nlq import runfiles
from nlq.errors import NlqError
from nlq.experiments.launch import Job

if TYPE_CHECKING:
    from nlq.experiments.slurm_settings import SlurmSettings


def _submitit():
    """submitit, or one error naming the extra that installs it."""
    from nlq.extras import need

    return need("submitit", "--launcher slurm")


class TrainRun:
    """What a submitted job runs, in the job: `python -m nlq CMD --no-progress` as its child,
    the child's output appended to the run's train.log; returns the child's exit status (the
    runner reads it as a local child's).

    Signals: SIGTERM or SIGINT to the job (the runner stopping: scancel --signal, or the local
    executor's controller forwarding it) is passed to the child as SIGTERM: it checkpoints at
    its next step boundary and exits. submitit's time-limit / preemption signal (SIGUSR2,
    signal_delay_s before the limit) calls checkpoint(): the child checkpoints and stops, and
    submitit requeues the job with this object, which then resumes the run (the child ignores
    SIGUSR2 itself, started with it blocked: Slurm sends it to every process of the job step,
    and its default action is to end the process). A run dir that holds a run already (a
    requeued job, Slurm's own requeue after a node failure) is resumed, never started again."""

    def __init__(self, cmd: list[str], run_dir: str, cwd: str, threads: int,
                 also: tuple[str, ...] = ()):
        """also: the other run dirs of a stack trained with run_dir (nlq/train/stack.py)."""
        self.cmd, self.run_dir, self.cwd, self.threads = list(cmd), run_dir, cwd, threads
        self.also = tuple(also)
        self._child: subprocess.Popen | None = None

    def __getstate__(self):
        return {**self.__dict__, "_child": None}

    def command(self) -> list[str]:
        if (Path(self.cwd) / self.run_dir / runfiles.CONFIG).is_file():
            stacked = ["--stacked"] if "--stacked" in self.cmd else []
            return ["train", "--resume", self.run_dir, *self.also, *stacked]
        return self.cmd

    def __call__(self) -> int:
        stop: list[int] = []

        def on_signal(signum, _frame):
            stop.append(signum)
            if self._child is not None and self._child.poll() is None:
                self._child.send_signal(signal.SIGTERM)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "NLQ_GPU_SHARE": "1"}
            log = Path(self.cwd) / self.run_dir / runfiles.TRAIN_LOG
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            # the child starts with the preemption signal blocked (a mask survives exec): it
            # never sees it; this process gets one that came meanwhile when it unblocks
            usr = _preemption_signal()
            signal.pthread_sigmask(signal.SIG_BLOCK, usr)
            try:
                self._child = subprocess.Popen(
                    [sys.executable, "-m", "nlq", *self.command(), "--no-progress"],
                    stdout=fd, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, usr)
                os.close(fd)
            if stop:  # a signal came before the child existed
                self._child.send_signal(signal.SIGTERM)
            return self._child.wait()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def checkpoint(self, *args, **kwargs):
        """submitit's time-limit / preemption handler calls this: stop the run at a
        checkpoint, then requeue this object (it resumes the run)."""
        from submitit.helpers import DelayedSubmission

        child = self._child
        if child is not None and child.returncode is None:
            child.send_signal(signal.SIGTERM)
            # wait for its exit without reaping it: this runs in a signal handler that
            # interrupted __call__'s child.wait(), which holds Popen's wait lock (a second
            # wait() here would block on it for ever) and reaps the child afterwards
            try:
                os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:  # reaped already
                pass
        return DelayedSubmission(self)


def _preemption_signal() -> set[int]:
    """submitit's time-limit / preemption signal (SUBMITIT_PREEMPT_SIGNAL, default USR2)."""
    sig = getattr(signal, f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}", None)
    return {sig} if sig is not None else set()


def _scancel(*args: str) -> None:
    try:
        subprocess.run(["scancel", *args], capture_output=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):  # no scancel here, or slurmctld unreachable
        pass


class SubmititProc:
    """A submitted job as the child process the runner polls: poll() (None while the job is
    queued or running), returncode (its `nlq train`'s exit status), send_signal(sig) (stop).

    A job that ended without a result (Slurm's TIMEOUT, NODE_FAIL, a cancel by hand) or with
    an error in the job has its cause appended to the run's train.log as one `nlq: error:`
    line, which the runner's failures.json records; OUT_OF_MEMORY reads as SIGKILL, as the
    kernel's out-of-memory killer does for a local child."""

    _last_forced = 0.0  # all jobs: when the cluster (sacct) was last asked, after a stop

    def __init__(self, job, settings: SlurmSettings, log: Path):
        self.job, self.settings, self.log = job, settings, log
        self.returncode: int | None = None
        self.signalled = False

    def poll(self) -> int | None:
        if self.returncode is None and self._done():
            self.returncode = self._outcome()
        return self.returncode

    def _done(self) -> bool:
        force = False
        if self.signalled and self.settings.executor == "slurm":
            # a job cancelled while queued writes no result: ask Slurm at most every 5 s
            # (submitit's own status refresh may wait up to 10 minutes)
            now = time.monotonic()
            if now - SubmititProc._last_forced >= 5:
                SubmititProc._last_forced, force = now, True
        return self.job.done(force_check=force)

    def _outcome(self) -> int:
        if self.signalled and not self.job.paths.result_pickle.exists():
            return -int(signal.SIGTERM)  # cancelled before it ran, or stopped without a result
        try:
            rc = self.job.result()
        except Exception as e:  # noqa: BLE001 (submitit's FailedJobError, UncompletedJobError)
            from submitit.core.utils import FailedJobError

            state = self._state()
            if state.startswith("OUT_OF_MEMORY"):
                return -int(signal.SIGKILL)
            if isinstance(e, FailedJobError):
                why = f"its {self.settings.executor} job failed: {_trace_tail(str(e))}"
            else:
                why = (f"its {self.settings.executor} job ended ({state or 'state unknown'}) "
                       f"before `nlq train` did; submitit's logs: {self.settings.folder}")
            _note(self.log, why)
            return 1
        return rc if isinstance(rc, int) else 1

    def _state(self) -> str:
        try:
            return str(self.job.state).upper()
        except Exception:  # noqa: BLE001 (sacct gone: the cause just says so)
            return ""

    def send_signal(self, sig: int) -> None:
        """Stop the run: it checkpoints at its next step boundary and its job ends; a job
        still queued is removed. Local executor: SIGTERM to submitit's controller, which
        passes it to the job (its cancel() sends SIGINT and kills the job a second later,
        which would orphan the run mid-checkpoint). Slurm: the queued job is cancelled, a
        running one signalled (scancel --signal: no SIGKILL after Slurm's KillWait)."""
        self.signalled = True
        if self.settings.executor == "local":
            proc = getattr(self.job, "_process", None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            return
        job_id = str(self.job.job_id)
        _scancel("--state=PENDING", job_id)
        _scancel(f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", job_id)


class Refused:
    """A job the cluster refused (sbatch failed: a bad partition or account, a full queue):
    a run that failed at once, its cause in train.log."""

    returncode = 1

    def __init__(self, log: Path, error: Exception):
        _note(log, f"submitting its job failed: {_trace_tail(str(error)) or type(error).__name__}")

    def poll(self) -> int:
        return 1

    def send_signal(self, sig: int) -> None:
        pass


def _trace_tail(text: str) -> str:
    """The last line of an error or traceback submitit relays that says something."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith(("---", "You can check", "or at paths",
                                                          "- /"))]
    return lines[-1] if lines else ""


def _note(log: Path, why: str) -> None:
    """Append the cause of a run's failure to its train.log, as its last line (the runner's
    failure_cause reads it)."""
    try:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "a") as f:
            f.write(f"nlq: error: {why}\n")
    except OSError:
        pass


@dataclass
class Slurm:
    """Each run a submitit job (settings.executor: Slurm, or submitit's local executor), at
    most `jobs` of them submitted at once."""

    settings: SlurmSettings
    jobs: int
    name: str = "slurm"
    _executor: object = field(default=None, repr=False, compare=False)  # made at the 1st run

    def __post_init__(self):
        _submitit()
        if self.settings.executor == "slurm" and shutil.which("sbatch") is None:
            raise NlqError(f"--launcher slurm: no `sbatch` here: run the command on the "
                           f"cluster's login node (or set executor = \"local\" in "
                           f"{self.settings.path} to try its runs on this machine)")

    def fits(self, running: list[Job], threads: int) -> bool:
        return len(running) < self.jobs

    def start(self, key, cmd, log, threads, running) -> Job:
        # the runner's RunSpecs (a stack's, or one run's): the first one's train.log is the log
        runs = list(key) if isinstance(key, (list, tuple)) else [key]
        run_dir = Path(runs[0].run_dir)
        task = TrainRun(cmd, str(run_dir), os.getcwd(), threads,
                        also=tuple(str(r.run_dir) for r in runs[1:]))
        more = f"+{len(runs) - 1}" if len(runs) > 1 else ""
        try:
            job = self._submit(task, threads,
                               f"nlq-{getattr(runs[0], 'arm', 'run')}-{run_dir.name}{more}")
        except Exception as e:  # noqa: BLE001 (sbatch refused it: this run failed, said why)
            return Job(key, Refused(run_dir / runfiles.TRAIN_LOG, e), log, threads)
        return Job(key, SubmititProc(job, self.settings, run_dir / runfiles.TRAIN_LOG), log,
                   threads)

    def _submit(self, task: TrainRun, threads: int, name: str):
        s = self.settings
        if self._executor is None:
            submitit = _submitit()
            kw = {}
            if "max_num_timeout" in s.params:
                kw[f"{s.executor}_max_num_timeout"] = s.params["max_num_timeout"]
            self._executor = submitit.AutoExecutor(folder=s.folder, cluster=s.executor, **kw)
            self._executor.update_parameters(**s.submitit_parameters())
        ex = self._executor
        ex.update_parameters(name=name, cpus_per_task=max(threads, s.params.get(
            "cpus_per_task", 1)))
        if s.executor != "local" or threading.current_thread() is not threading.main_thread():
            return ex.submit(task)
        # the local executor's controller inherits SIGINT ignored: a Ctrl-C in the terminal
        # reaches the run itself (and the runner, which passes SIGTERM on); the controller
        # would kill the job a second later, the run orphaned mid-checkpoint
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            job = ex.submit(task)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        # a local job's id is its controller's pid: one an earlier command's job had in this
        # folder leaves a result that submitit would take for this job's (the job has not
        # started yet: Python and submitit load first)
        job.paths.result_pickle.unlink(missing_ok=True)
        return job
