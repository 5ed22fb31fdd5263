"""Running an experiment's planned runs: the bookkeeping every launcher shares.

Before anything is written, each planned run's state (run_states): finished (skipped),
resume (a checkpoint), or new; a run dir holding another config is refused, naming the keys
that differ. Then run_all trains what is left through a launcher (nlq/experiments/launch.py:
local processes within a thread budget, one run per GPU, or Slurm jobs through submitit): each
run is a child `nlq train` (on Slurm, its job's child), so a crash or a divergence of one never
takes the others down. SIGINT / SIGTERM to the command stop it cleanly: no new run starts, the
signal is passed to every running child (each checkpoints at its next step boundary and
exits), and the command waits for them, then raises
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
from dataclasses import dataclass
from pathlib import Path

from nlq import runfiles
from nlq.config import Config, flatten, load_config
from nlq.errors import NlqError
from nlq.experiments.launch import LauncherSpec, make_launcher
from nlq.fsutil import write_atomic
from nlq.runfiles import read_summary


@dataclass(frozen=True)
class RunSpec:
    arm: str
    seed_index: int
    cfg: Config
    run_dir: Path
    tag: str = ""  # e.g. a sweep's lr: part of the config file's name
    replicate: bool = False
    """A numerical replicate: the run of (arm, seed_index) again at another thread count,
    i.e. another float summation order; it measures rounding noise and is never a seed."""

    @property
    def config_name(self) -> str:
        rep = f"-threads{self.cfg.train.threads}" if self.replicate else ""
        return f"{self.tag}{self.arm}-seed{self.seed_index}{rep}.toml"

    @property
    def threads(self) -> int:
        return self.cfg.train.threads or 1


class Interrupted(NlqError):
    """The command was stopped by a signal; its running runs checkpointed and stopped."""

    def __init__(self, signum: int, stopped: list[str]):
        self.signum, self.stopped = signum, stopped
        self.exit_code = 128 + signum  # the shell's convention for a command a signal ended
        super().__init__(f"stopped by signal {signum}; {len(stopped)} running run(s) "
                         f"checkpointed and stopped: run the same command again to continue")


# What an nlq reproduce / sweep / study writes at the top of its --out (a study's rungs hold
# rung.json; its report study.json): a folder holding any of them is one of ours.
OURS = ("experiment.toml", "configs", "runs", "lrs.json", "report.json", "report.md",
        "sweep-plan.json", "sweep.json", "study.json", "study.md", "rung.json",
        "failures.json")
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


def check_out(out: Path, command: str) -> None:
    """--out must be new, empty, or a folder an nlq reproduce / sweep / study wrote (or one
    of a study's rung folders): a folder of the user's is refused before anything is written
    there, naming what it holds."""
    if not out.exists():
        return
    if not out.is_dir():
        raise NlqError(f"{command} --out {out} is a file, not a folder")
    names = sorted(p.name for p in out.iterdir())
    if not names or any(n in OURS for n in names) or any(
            (out / n / "rung.json").is_file() for n in names):
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise NlqError(f"{command} --out {out} holds files nlq did not write ({shown}): give a new "
                   f"or empty folder, or the folder of an earlier `nlq {command}`")


def auto_gpu_jobs(specs: list[RunSpec], n_gpus: int, cores: int, total_bytes: int,
                  stack: int = 1) -> int:
    """--jobs auto on a GPU: the processes one GPU takes at once: as many as 90% of its
    memory holds by the largest run's estimate (nlq/run/memory.py) times the runs a process
    stacks, and the CPU cores can feed (one core a process, its --threads), at least 1."""
    import torch

    from nlq.run.memory import estimate

    need = max(estimate(s.cfg, torch.device("cuda")).total for s in specs) * stack
    by_memory = int(0.9 * total_bytes // need)
    by_cores = cores // (max(s.threads for s in specs) * max(1, n_gpus))
    processes = len(stack_groups([(s, "new") for s in specs], stack))
    return max(1, min(by_memory, by_cores, processes))


def resolve_jobs(jobs: int | None, specs: list[RunSpec], launcher: LauncherSpec,
                 command: str = "reproduce", stack: int = 1) -> int:
    """jobs, or for auto (None, on a GPU) auto_gpu_jobs over this machine's GPUs."""
    if jobs is not None:
        return jobs
    import torch

    from nlq.experiments.launch import visible_gpus
    from nlq.sysinfo import cores

    n = len(visible_gpus()) if launcher == "gpus" else 1
    jobs = auto_gpu_jobs(specs, n, cores(), int(torch.cuda.mem_get_info()[1]), stack)
    what = f"stack(s) of up to {stack} runs" if stack > 1 else "run(s)"
    print(f"{command}: --jobs auto: {jobs} {what} at a time per GPU", file=sys.stderr)
    return jobs


def run_states(specs: list[RunSpec], command: str = "reproduce",
               stack: int = 1) -> dict[Path, str]:
    """Each planned run's state (_run_state), every one checked before anything is written:
    a command that is refused leaves OUT as it was. command: the name messages start with.
    stack: the plan's --stack; a run trained the other way (stacked or alone) is refused,
    since the two sum their floats in other orders (nlq/train/stack.py)."""
    states = {s.run_dir: _run_state(s, command) for s in specs}
    for s in specs:
        was = _trained_stacked(s.run_dir) if states[s.run_dir] != "new" else None
        if was is not None and was != (stack > 1):
            how = "stacked" if was else "alone"
            now = f"--stack {stack}" if stack > 1 else "alone (no --stack)"
            raise NlqError(f"{s.run_dir} was trained {how}, and this command trains {now}: a "
                           f"plan's runs are all stacked or all alone (they sum floats in "
                           f"other orders); use the same --stack, or another --out")
    return states


def _trained_stacked(run_dir: Path) -> bool | None:
    """Whether a run was trained in a stack: its summary's "stack", else its meta row's (None:
    neither is there)."""
    summary, _ = read_summary(run_dir)
    if summary is not None:
        return bool(summary.get("stack"))
    try:
        with open(run_dir / runfiles.METRICS, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if isinstance(row, dict) and row.get("kind") == "meta":
                    return bool(row.get("stack"))
    except (OSError, ValueError):
        pass
    return None


def _run_state(spec: RunSpec, command: str = "reproduce") -> str:
    """finished, resume or new. A run dir is reused (finished, or resumed) only when the
    config it holds, resolved as this nlq reads it, equals the one planned for it, key for
    key: one of another config (e.g. another lr or max_steps) is an error, finished or not,
    naming the keys that differ: its numbers would answer another question."""
    d = spec.run_dir
    summary, why = read_summary(d)
    if (d / runfiles.CONFIG).is_file():
        diff = config_diff(load_config(d / runfiles.CONFIG), spec.cfg)
        if diff:
            what = "; ".join(f"{k} = {a!r} there, {b!r} now" for k, a, b in diff[:4])
            more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
            raise NlqError(f"{d} holds a run of another config than this command plans (arm "
                           f"{spec.arm!r}, seed {spec.seed_index}: {what}{more}): use another "
                           f"--out, or remove {d} to train it again")
    elif summary is not None or why is not None:
        raise NlqError(f"{d} holds summary.json but no config.toml: what it ran cannot be "
                       f"checked against this plan; use another --out, or remove {d}")
    if summary is not None:
        return "finished"
    saved = any((d / runfiles.CKPT).glob("step_*"))
    if why is not None and not saved:
        raise NlqError(f"{d / runfiles.SUMMARY} {why}, and {d} holds no checkpoint to recompute "
                       f"it from: restore the file, or remove {d} to train the run again")
    if why is not None:
        print(f"{command}: warning: {d / runfiles.SUMMARY} {why}: the run is resumed from its "
              f"last checkpoint, which writes it again", file=sys.stderr)
    return "resume" if saved else "new"


def config_diff(a: Config, b: Config) -> list[tuple[str, object, object]]:
    """(key, value in a, value in b) for every key where the resolved configs differ, as plain
    values: nothing is left out (train.device is compared as written, "auto" included)."""
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return [(k, fa.get(k, "(absent)"), fb.get(k, "(absent)")) for k in sorted(set(fa) | set(fb))
            if fa.get(k, "(absent)") != fb.get(k, "(absent)")]


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


def stack_groups(todo: list[tuple[RunSpec, str]], stack: int) -> list[list[RunSpec]]:
    """The runs left, in groups of at most `stack` that train as one stacked model
    (nlq/train/stack.py): runs of one config but for their seeds (one arm at one lr), all new
    or all resumed from checkpoints of one step; in plan order. stack 1: one run a group."""
    if stack <= 1:
        return [[s] for s, _ in todo]
    keyed: dict[tuple, list[RunSpec]] = {}
    for s, state in todo:
        same = s.cfg.replace(**{"train.seed": 0, "data.seed": 0}).to_toml()
        at = _ckpt_step(s.run_dir) if state == "resume" else None
        keyed.setdefault((s.arm, state, at, same, s.replicate), []).append(s)
    return [g[i:i + stack] for g in keyed.values() for i in range(0, len(g), stack)]


def _ckpt_step(run_dir: Path) -> int | None:
    """The step of a run's latest checkpoint, as ckpt/latest names it."""
    try:
        return int((run_dir / runfiles.CKPT / "latest").read_text().strip().split("_")[-1])
    except (OSError, ValueError):
        return None


def run_all(specs: list[RunSpec], exp, jobs: int, out: Path,
            states: dict[Path, str] | None = None,
            launcher: LauncherSpec = "local", command: str = "reproduce",
            stack: int = 1) -> list[str]:
    """Train every planned run that is not finished, `jobs` at a time through the launcher
    named (nlq/experiments/launch.py; "local": within jobs x the runs' threads of CPU; slurm:
    its SlurmSettings, from --slurm FILE);
    returns the arms/seeds that failed. Raises Interrupted when a signal stopped the command
    (after its running children stopped). states: run_states(specs), if checked already;
    command: the name its messages start with (reproduce or sweep). stack: up to that many
    seeds of one arm and lr train as one stacked model in one `nlq train` (stack_groups; a
    job of the launcher), its output in the first one's train.log."""
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
               desc=f"{len(todo)} runs", file=sys.stderr)

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
                    _ended(s, job, out, command, causes, failed, stopped, twice, signals, bar)
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
           stopped: list, twice: list, signals: list, bar) -> None:
    """Book run s of a job that ended: finished (its summary), stopped by the command's
    signal, or failed (its cause recorded in OUT/failures.json; twice alike is noted)."""
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
