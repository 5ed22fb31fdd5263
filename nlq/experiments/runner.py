"""Running an experiment's planned runs: the bookkeeping every launcher shares.

Before anything is written, each planned run's state (nlq/experiments/plan.py run_states):
finished (skipped), resume (a checkpoint), or new; a run dir holding another config is
refused, naming the keys that differ. Then run_all trains what is left through a launcher
(nlq/experiments/launch.py: local processes within a thread budget, one run per GPU, or Slurm
jobs through submitit): each run is a child `nlq train` (on Slurm, its job's child), so a
crash or a divergence of one never takes the others down. SIGINT / SIGTERM to the command stop
it cleanly: no new run starts, the signal is passed to every running child (each checkpoints
at its next step boundary and exits), and the command waits for them, then raises
Interrupted; the same command continues where they stopped, to the same numbers. A run that
fails (an error, or killed: the out-of-memory killer's SIGKILL) is recorded with its cause in
OUT/failures.json while the others go on; the next command retries it, and a second failure
of the same cause stops that command with one line naming the run and the cause.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nlq import runfiles
from nlq.errors import NlqError
from nlq.experiments.launch import LauncherSpec, make_launcher
from nlq.experiments.plan import RunSpec, run_states, stack_groups
from nlq.fsutil import write_atomic
from nlq.progress import bar_interval
from nlq.runfiles import read_summary


class Interrupted(NlqError):
    """The command was stopped by a signal; its running runs checkpointed and stopped."""

    def __init__(self, signum: int, stopped: list[str]):
        self.signum, self.stopped = signum, stopped
        self.exit_code = 128 + signum  # the shell's convention for a command a signal ended
        super().__init__(f"stopped by signal {signum}; {len(stopped)} running run(s) "
                         f"checkpointed and stopped: run the same command again to continue")


# Why each failed run failed last time (run dir relative to OUT -> cause), so that a run that
# fails again the same way stops the command instead of being retried for ever. Outside the
# run dirs: a run that failed before its first checkpoint starts again from an empty dir.
FAILURES = "failures.json"


def failure_cause(returncode: int, log: Path) -> str:
    """Why a child `nlq train` ended without a summary, in one line: the signal that killed
    it (SIGKILL is what the kernel's out-of-memory killer sends), or its last line (nlq's one
    `nlq: error:` line, e.g. CUDA out of memory)."""
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else ""
        oom = " (the out-of-memory killer sends it)" if returncode == -signal.SIGKILL else ""
        return f"killed by signal {-returncode} {name}{oom}".replace("  ", " ")
    try:
        tail = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        tail = []
    return f"exit {returncode}: {tail[-1] if tail else '(no output)'}"


def _last_step(run_dir: Path) -> int:
    """The last logged step of a running run (for the progress bar only)."""
    try:
        with open(run_dir / runfiles.METRICS, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode("utf-8", "replace").splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line).get("step", 0))
            except (AttributeError, ValueError, TypeError):  # not JSON, not a row, no step
                continue
    except OSError:
        pass
    return 0


def run_all(specs: list[RunSpec], exp, jobs: int, out: Path,
            states: dict[Path, str] | None = None,
            launcher: LauncherSpec = "local", command: str = "reproduce",
            stack: int = 1, after_run: Callable[[Path], object] | None = None) -> list[str]:
    """Train every planned run that is not finished, `jobs` at a time through the launcher
    named (nlq/experiments/launch.py; "local": within jobs x the runs' threads of CPU; slurm:
    its SlurmSettings, from --slurm FILE);
    returns the arms/seeds that failed. Raises Interrupted when a signal stopped the command
    (after its running children stopped). states: run_states(specs), if checked already;
    command: the name its messages start with (reproduce or sweep). stack: up to that many
    seeds of one arm and lr train as one stacked model in one `nlq train` (stack_groups; a
    job of the launcher), its output in the first one's train.log. after_run(run_dir): called
    as each run finishes (the study's --export copies it at once); an error it raises is
    printed as a warning, and the runs go on."""
    from tqdm import tqdm

    states = states or run_states(specs, command, stack)
    todo = []
    for s in specs:
        state = states[s.run_dir]
        if state == "finished":
            continue
        if state == "new":
            shutil.rmtree(s.run_dir, ignore_errors=True)  # a start that never checkpointed
            s.run_dir.mkdir(parents=True)
            rep = {"replicate": True} if s.replicate else {}
            write_atomic(s.run_dir / runfiles.ARM, json.dumps(
                {"experiment": exp.name, "arm": s.arm, "seed_index": s.seed_index, **rep}))
        todo.append((s, state))
    if not todo:
        print(f"{command}: all {len(specs)} runs finished already", file=sys.stderr)
        return []
    groups = []
    for g in stack_groups(todo, stack):
        dirs = [str(s.run_dir) for s in g]
        if states[g[0].run_dir] == "new":
            cmd = ["train", *(str(out / "configs" / s.config_name) for s in g), "--out", *dirs]
        else:
            cmd = ["train", "--resume", *dirs]
        if stack > 1:  # a seed left on its own keeps the stacked recipe
            cmd.append("--stacked")
        groups.append((g, cmd))
    total = sum(s.cfg.train.max_steps for s, _ in todo)
    done_steps = {s.run_dir: _last_step(s.run_dir) for s, _ in todo}
    # a replicate at more threads than the command's waits for room in the budget
    launch = make_launcher(launcher, jobs, max([s.threads for s in specs if not s.replicate]
                                               or [1]))
    failed, stopped, running, queue = [], [], [], list(groups)
    causes = _read_failures(out / FAILURES)
    twice: list[tuple[str, str]] = []  # runs that failed again as they did last time
    signals: list[int] = []
    bar = tqdm(total=total, initial=sum(done_steps.values()), unit="step", dynamic_ncols=True,
               desc=f"{len(todo)} runs", file=sys.stderr, mininterval=bar_interval())

    def on_signal(signum, _frame):
        # no new run starts; every running child gets SIGTERM (from a terminal, Ctrl-C has
        # reached them already: a second signal changes nothing for `nlq train`), checkpoints
        # at its next step boundary and exits; the loop below waits for them
        if not signals:
            bar.write(f"{command}: signal {signum}: stopping the {len(running)} running "
                      f"run(s) at their next step boundary (they checkpoint first)")
        signals.append(signum)
        for job in running:
            if job.proc.poll() is None:
                job.proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while (queue and not signals) or running:
            while queue and not signals and launch.fits(running, queue[0][0][0].threads):
                g, cmd = queue.pop(0)
                # open while the run lives: closed when it ends, below; never through a symlink
                log = open_log(g[0].run_dir / runfiles.TRAIN_LOG)
                for s in g[1:]:
                    with open_log(s.run_dir / runfiles.TRAIN_LOG) as note:
                        first = g[0].run_dir / runfiles.TRAIN_LOG
                        note.write(f"{command}: trained as one stack with {len(g) - 1} other "
                                   f"run(s); the output is in {first}\n")
                running.append(launch.start(g, cmd, log, g[0].threads, running))
            time.sleep(0.5)
            for job in list(running):
                for s in job.key:
                    now = _last_step(s.run_dir)
                    bar.update(now - done_steps[s.run_dir])
                    done_steps[s.run_dir] = now
                if job.proc.poll() is None:
                    continue
                running.remove(job)
                job.log.close()
                for s in job.key:  # a stack's runs: each finished or not on its own
                    done = _ended(s, job, out, command, causes, failed, stopped, twice,
                                  signals, bar)
                    if done and after_run is not None:
                        try:
                            after_run(s.run_dir)
                        except (OSError, NlqError) as e:  # a full disk there: train on
                            bar.write(f"{command}: warning: {s.arm} {s.run_dir.name}: "
                                      f"{getattr(e, 'strerror', None) or e}")
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        bar.close()
    if signals:
        raise Interrupted(signals[0], stopped)
    if twice:
        key, cause = twice[0]
        more = f" (and {len(twice) - 1} more run(s) likewise)" if len(twice) > 1 else ""
        raise NlqError(f"run {out / key} failed twice the same way: {cause}{more}; see its "
                       f"{runfiles.TRAIN_LOG} and remove the cause (memory: fewer --jobs or "
                       f"a smaller micro-batch) before running the command again")
    return failed


def _ended(s: RunSpec, job, out: Path, command: str, causes: dict, failed: list,
           stopped: list, twice: list, signals: list, bar) -> bool:
    """Book run s of a job that ended: finished (its summary; returns True), stopped by the
    command's signal, or failed (its cause recorded in OUT/failures.json; twice alike is
    noted)."""
    summ = read_summary(s.run_dir)[0]  # a stack's run may finish though another failed
    key = str(s.run_dir.relative_to(out)) if s.run_dir.is_relative_to(out) else str(s.run_dir)
    if summ is not None and causes.pop(key, None) is not None:
        write_atomic(out / FAILURES, json.dumps(causes, indent=2))
    if summ is not None:
        bar.write(f"{command}: {s.arm} {s.run_dir.name}: val loss "
                  f"{summ['val_loss']:.4f} ({summ['tok_per_s']:,.0f} tok/s)")
    elif signals:  # stopped by the signal, at a checkpoint
        stopped.append(f"{s.arm}/{s.run_dir.name}")
    else:  # failed: the others go on; the next command retries it, once
        failed.append(f"{s.arm}/{s.run_dir.name}")
        cause = failure_cause(job.proc.returncode, job.key[0].run_dir / runfiles.TRAIN_LOG)
        if causes.get(key) == cause:
            twice.append((key, cause))
        causes[key] = cause
        write_atomic(out / FAILURES, json.dumps(causes, indent=2))
        bar.write(f"{command}: {s.arm} {s.run_dir.name} failed: {cause}")
    return summ is not None


def _read_failures(path: Path) -> dict[str, str]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: start a new record
        return {}
    return {k: v for k, v in d.items() if isinstance(v, str)} if isinstance(d, dict) else {}


def open_log(path: Path):
    """A run's train.log for appending, never through a symlink."""
    import os

    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                             0o666), "a")
