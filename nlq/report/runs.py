"""Reading run folders: what the trainer (config.toml, metrics.jsonl, summary.json when
finished) and the experiment runner (arm.json: experiment, arm, seed_index, label, replicate)
wrote.

A run without arm.json belongs to the arm named by its parent folder, its seed is
train.seed. Only finished runs (summary.json with status "finished" and a finite val_loss)
enter the statistics; the others keep the reason in Run.problem.

A run whose arm.json says "replicate": true is a numerical replicate (`nlq reproduce
--replicates`): the run of its arm and seed again at another thread count, so with floats
summed in another order. It is never a seed: the seed statistics read primary runs only,
and the report's rounding-noise section (nlq/report/noise.py) sets each replicate beside the
primary run of its arm and seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from nlq import runfiles
from nlq.config import Config, load_config
from nlq.errors import NlqError


@dataclass
class Run:
    dir: Path
    arm: str
    seed: int | str
    """arm.json's seed_index if given, else train.seed: runs of two arms with the same seed
    are paired."""
    label: str | None = None
    experiment: str | None = None
    cfg: Config | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)
    """(step, val_loss), sorted; for a step logged twice (a resumed run) the later line wins."""
    summary: dict | None = None
    problem: str | None = None
    """Why the run is not in the statistics (None for a finished run)."""
    notes: list[str] = field(default_factory=list)
    loss_key: str = "val_loss"
    """The summary key the statistics use: test_loss when every run has one (nlq.report.summary)."""
    replicate: bool = False
    """arm.json's "replicate": the same arm and seed at another thread count, not a seed."""

    @property
    def finished(self) -> bool:
        return self.problem is None

    @property
    def final_loss(self) -> float:
        return float(self.summary[self.loss_key])

    @property
    def tokens_per_step(self) -> int | None:
        if self.cfg is None:
            return None
        t = self.cfg.train
        return t.micro_batch * t.grad_accum * self.cfg.model.block_size

    @property
    def tokens(self) -> int | None:
        if self.summary and "tokens" in self.summary:
            return int(self.summary["tokens"])
        if self.summary and "step" in self.summary and self.tokens_per_step:
            return int(self.summary["step"]) * self.tokens_per_step
        return None

    @property
    def last_step(self) -> int | None:
        return self.evals[-1][0] if self.evals else None

    def machine(self, key: str):
        """summary.json's record of what summed the run's floats ("threads", "isa", "cpu":
        nlq/sysinfo.py machine_record), None for a run that predates it."""
        v = (self.summary or {}).get(key)
        ok = runfiles.is_int(v) if key == "threads" else isinstance(v, str)
        return v if ok else None

    @property
    def run_key(self) -> tuple:
        """(arm, seed) for a primary run; for a replicate, with its thread count (or its
        folder's name, where none is recorded), so replicates of two arms at the same thread
        count pair with each other."""
        if not self.replicate:
            return (self.arm, self.seed)
        tag = self.machine("threads") or (self.cfg and self.cfg.train.threads) or self.dir.name
        return (self.arm, self.seed, tag)


def final(runs: list[Run]) -> dict:
    """{seed: final loss} of an arm's runs: what paired comparisons pair by seed."""
    return {r.seed: r.final_loss for r in runs}


def find_runs(paths: Iterable[str | Path]) -> list[Path]:
    """Run folders (those holding config.toml) given run folders or experiment folders
    (runs/<arm>/seed<k>/ below them, or any run folder up to 3 levels down)."""
    found: dict[Path, None] = {}
    for p in map(Path, paths):
        if not p.exists():
            raise NlqError(f"run dir not found: {p}")
        if not p.is_dir():
            raise NlqError(f"{p} is not a folder (expected a run dir or an experiment dir)")
        if (p / runfiles.CONFIG).is_file():
            found[p.resolve()] = None
            continue
        below = sorted(c.parent for depth in ("*", "*/*", "*/*/*")
                       for c in p.glob(f"{depth}/config.toml"))
        if not below:
            raise NlqError(f"no run in {p} (expected config.toml there, or "
                           f"runs/<arm>/seed<k>/config.toml below it)")
        for c in below:
            found[c.resolve()] = None
    return list(found)


def read_run(d: Path) -> Run:
    arm_info = read_json(d / runfiles.ARM)
    arm = str(arm_info.get("arm") or d.parent.name) if isinstance(arm_info, dict) else d.parent.name
    info = arm_info if isinstance(arm_info, dict) else {}
    text = {k: v for k, v in info.items() if k in ("label", "experiment") and isinstance(v, str)}
    run = Run(dir=d, arm=arm, seed="?", replicate=info.get("replicate") is True, **text)
    if arm_info is BAD:
        run.notes.append("arm.json is not valid JSON: arm taken from the folder name")
    if "seed_index" in info and not runfiles.is_int(info["seed_index"]):
        run.notes.append(f"arm.json seed_index {info.pop('seed_index')!r} is not an integer: "
                         f"seed taken from train.seed")
    try:
        run.cfg = load_config(d / runfiles.CONFIG)
    except NlqError as e:
        run.problem = f"config.toml unreadable: {e}"
        return run
    run.seed = info.get("seed_index", run.cfg.train.seed)
    run.evals, bad = _read_evals(d / runfiles.METRICS)
    if bad:
        run.notes.append(f"{bad} unreadable line(s) in metrics.jsonl skipped")
    summary, why = runfiles.read_summary(d)  # the one reader of a run's summary
    if why is not None:
        run.problem = f"summary.json {why}"
    elif summary is None:
        at = f" (last eval at step {run.last_step})" if run.evals else " (no eval logged)"
        run.problem = "no summary.json: not finished" + at
    elif not isinstance(summary.get("val_loss"), (int, float)) or isinstance(
            summary["val_loss"], bool) or not math.isfinite(summary["val_loss"]):
        run.problem = (f"finished, but summary.json val_loss is {summary.get('val_loss')!r}, "
                       f"not a finite number (diverged?)")
    else:
        run.summary = summary = runfiles.checked_summary(summary, run.notes)
        if not run.evals:
            run.notes.append("no eval lines in metrics.jsonl: not drawn in Fig. 1")
        elif run.evals[-1][0] == summary.get("step") and not math.isclose(
                run.evals[-1][1], summary["val_loss"], rel_tol=1e-6):
            run.notes.append(f"final eval in metrics.jsonl ({run.evals[-1][1]:.6g}) differs "
                             f"from summary.json val_loss ({summary['val_loss']:.6g})")
    return run


BAD = object()  # marker: the file exists but cannot be read as JSON


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # a folder, no permission; not JSON, not UTF-8
        return BAD


def _read_evals(path: Path) -> tuple[list[tuple[int, float]], int]:
    by_step: dict[int, float] = {}
    bad = 0
    try:
        # bytes that are not UTF-8 (a torn write) are read as U+FFFD: the line then fails
        # json.loads, and is counted, unless they sat inside a string
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # e.g. the last line of a run killed mid-write
            continue
        if not isinstance(rec, dict):
            bad += 1  # valid JSON, but not a row nlq writes
            continue
        if rec.get("kind") != "eval":
            continue
        step, loss = rec.get("step"), rec.get("val_loss")
        if not runfiles.is_int(step) or not isinstance(loss, (int, float)) or isinstance(loss, bool):
            bad += 1  # an eval line without an integer step and a numeric val_loss
            continue
        by_step[step] = float(loss)
    return sorted(by_step.items()), bad


def collect(run_dirs: Iterable[str | Path]) -> list[Run]:
    """Every run under run_dirs (see find_runs), finished or not, in folder order."""
    runs = [read_run(d) for d in find_runs(run_dirs)]
    seen: dict[tuple, Path] = {}
    for r in runs:
        if r.finished:
            key = r.run_key
            if key in seen:
                what = "replicates" if r.replicate else "runs"
                at = f" ({'threads ' * runfiles.is_int(key[2])}{key[2]})" if r.replicate else ""
                raise NlqError(f"arm {r.arm!r} has two finished {what} with seed {r.seed!r}"
                               f"{at}: {seen[key]} and {r.dir} (pass only one of them)")
            seen[key] = r.dir
    return runs
