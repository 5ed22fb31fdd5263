"""An experiment's planned runs, and what each run dir holds before anything is trained.

Each planned run's state (run_states): finished (skipped), resume (a checkpoint), or new; a run
dir holding another config is refused, naming the keys that differ; every run is checked before
anything is written, so a refused command leaves OUT as it was. Then runs of one config but for
their seeds are grouped into stacks (stack_groups), and --jobs auto sized (resolve_jobs).
nlq/experiments/runner.py trains what is left.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from nlq import runfiles
from nlq.config import Config, flatten, load_config
from nlq.errors import NlqError
from nlq.experiments.launch import LauncherSpec
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


# What an nlq reproduce / sweep / study writes at the top of its --out (a study's rungs hold
# rung.json; its report study.json): a folder holding any of them is one of ours.
OURS = ("experiment.toml", "configs", "runs", "lrs.json", "report.json", "report.md",
        "sweep-plan.json", "sweep.json", "study.json", "study.md", "rung.json",
        "failures.json")


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
