"""`nlq sweep`: tune every arm's lr alike, on val, before the seed runs.

Every arm trains at every lr of one grid (x2 steps, at least 3 values) for the same seeds
(seed k: init and data order, as in `nlq reproduce`), each run an ordinary `nlq train` run dir
under OUT/runs/lr<lr>/<arm>/seed<k>/; min_lr keeps the preset's min_lr / lr ratio. Each arm's
lr is chosen on final VAL loss (mean over seeds; the test split is never looked at), and
written with the commit that chose it to OUT/sweep.json, with the loss-vs-lr figure
OUT/sweep.png. `nlq reproduce --lrs-from OUT/sweep.json` then runs the seeds at those lrs, so
the baseline gets exactly the tuning the variant gets.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from nlq.errors import NlqError
from nlq.experiments.experiment import load_experiment
from nlq.experiments.reproduce import RunSpec, ensure_data, plan, run_all, run_states
from nlq.fsutil import write_atomic
from nlq.train.rundir import read_summary

PLAN_FILE, RESULT_FILE, FIGURE_FILE = "sweep-plan.json", "sweep.json", "sweep.png"


def check_grid(lrs: list[float]) -> list[float]:
    """At least 3 finite positive values, increasing by x2 steps (within 1e-6)."""
    for v in lrs:
        if not (math.isfinite(v) and v > 0):
            raise NlqError(f"--lrs: {v!r} is not a positive finite learning rate")
    if len(lrs) < 3:
        raise NlqError(f"--lrs needs at least 3 values (x2 steps), got {len(lrs)}")
    for a, b in itertools.pairwise(lrs):
        if abs(b / a - 2.0) > 2e-6:
            raise NlqError(f"--lrs must rise in x2 steps: {b!r} after {a!r} is x{b / a:.4g}")
    return lrs


def lr_tag(lr: float) -> str:
    return f"lr{lr:.4g}"


def sweep_plan(experiment: str, preset: str, arms: list[str] | None, lrs: list[float],
               seeds: int, out: Path, sets: dict | None) -> tuple[list[RunSpec], dict]:
    check_grid(lrs)
    if seeds < 2:
        raise NlqError(f"--seeds must be >= 2 for a sweep (the choice averages over seeds), "
                       f"got {seeds}")
    exp = load_experiment(experiment)
    base = plan(exp, preset, seeds, arms, out, sets)
    specs = []
    for lr in lrs:
        for s in base:
            ratio = s.cfg.train.min_lr / s.cfg.train.lr
            # the test split is never looked at while choosing: not even computed
            cfg = s.cfg.replace(**{"train.lr": lr, "train.min_lr": lr * ratio,
                                   "train.test_eval": False})
            specs.append(replace(s, cfg=cfg, tag=f"{lr_tag(lr)}-",
                                 run_dir=out / "runs" / lr_tag(lr) / s.arm / f"seed{s.seed_index}"))
    meta = {"experiment": exp.name, "preset": preset, "arms": sorted({s.arm for s in base}),
            "grid": lrs, "seeds": seeds, "sets": {k: sets[k] for k in sorted(sets or {})}}
    return specs, meta


def source_commit() -> tuple[str | None, bool | None]:
    """HEAD of the git checkout nlq runs from, and whether its code (nlq/, pyproject.toml)
    differs from it: committed results or docs being rewritten do not make a run dirty."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "nlq", "pyproject.toml"],
                               cwd=root, capture_output=True, text=True, check=True).stdout
        return sha, bool(dirty.strip())
    except (OSError, subprocess.CalledProcessError):
        return None, None


def choose(specs: list[RunSpec], meta: dict) -> dict:
    """sweep.json's content from the finished runs: final val loss per arm, lr and seed."""
    results: dict[str, dict[str, list[float]]] = {}
    for s in specs:
        summary, why = read_summary(s.run_dir)
        loss = summary.get("val_loss") if summary else None
        if not isinstance(loss, (int, float)) or isinstance(loss, bool):
            raise NlqError(f"{s.run_dir / 'summary.json'} "
                           f"{why or f'has no numeric val_loss (val_loss = {loss!r})'}: no lr "
                           f"is chosen from it; remove {s.run_dir} to train it again")
        results.setdefault(s.arm, {}).setdefault(repr(s.cfg.train.lr), []).append(loss)
    chosen, edge = {}, {}
    for arm, by_lr in results.items():
        means = {float(lr): sum(v) / len(v) for lr, v in by_lr.items()}
        best = min(means, key=lambda lr: (means[lr], lr))
        chosen[arm] = {"lr": best, "val_loss": means[best]}
        edge[arm] = best in (min(means), max(means))
    sha, dirty = source_commit()
    return {**meta, "commit": sha, "dirty": dirty, "metric": "val_loss",
            "results": results, "chosen": chosen, "edge": edge}


def sweep(experiment: str, preset: str, arms: list[str] | None, lrs: list[float], seeds: int,
          out: Path, jobs: int, sets: dict | None = None) -> int:
    from nlq.experiments.sweep_figure import draw_sweep

    specs, meta = sweep_plan(experiment, preset, arms, lrs, seeds, out, sets)
    plan_path = out / PLAN_FILE
    if plan_path.is_file():
        # another grid or other arms are allowed (widening reuses every finished run: each
        # run dir refuses another config); other seeds or settings would mix two choices
        try:
            before = json.loads(plan_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise NlqError(f"{plan_path} cannot be read ({e}): it records the sweep in {out}; "
                           f"restore it, or use another --out (its runs are kept)") from None
        if not isinstance(before, dict):
            raise NlqError(f"{plan_path} is not a sweep plan (a JSON object): restore it, or "
                           f"use another --out")
        diff = [k for k in meta if k not in ("grid", "arms") and before.get(k) != meta[k]]
        if diff:
            raise NlqError(f"{out} holds a sweep with another plan ({', '.join(diff)}: "
                           f"{before.get(diff[0])!r}, now {meta[diff[0]]!r}): use another --out "
                           f"(its runs are kept)")
    states = run_states(specs)  # a run dir of another config is refused before any write
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(plan_path, json.dumps(meta, indent=2))
    (out / "configs").mkdir(exist_ok=True)
    for s in specs:
        write_atomic(out / "configs" / s.config_name, s.cfg.to_toml())
    ensure_data(preset, specs[0].cfg)
    failed = run_all(specs, load_experiment(experiment), jobs, out, states)
    if failed:
        print(f"sweep: {len(failed)} run(s) failed: {', '.join(failed)} (see their train.log; "
              f"run the command again to retry); no lr chosen", file=sys.stderr)
        return 1
    result = choose(specs, meta)
    write_atomic(out / RESULT_FILE, json.dumps(result, indent=2))
    draw_sweep(result, out / FIGURE_FILE)
    print_sweep(result, out)
    return 0


def print_sweep(result: dict, out: Path) -> None:
    grid = result["grid"]
    print(f"sweep: final val loss, mean over {result['seeds']} seeds "
          f"({result['preset']} preset, commit {(result['commit'] or 'unknown')[:10]}"
          f"{', dirty' if result['dirty'] else ''})")
    print("| arm | " + " | ".join(f"lr {lr:.3g}" for lr in grid) + " | chosen |")
    print("|---|" + "---|" * (len(grid) + 1))
    for arm, by_lr in result["results"].items():
        cells = [sum(by_lr[repr(lr)]) / len(by_lr[repr(lr)]) for lr in grid]
        c = result["chosen"][arm]
        flag = " (edge of the grid: widen it)" if result["edge"][arm] else ""
        print(f"| {arm} | " + " | ".join(f"{v:.4f}" for v in cells) +
              f" | {c['lr']:.3g}{flag} |")
    print(f"wrote {out / RESULT_FILE}, {out / FIGURE_FILE}; use them with "
          f"`nlq reproduce --lrs-from {out / RESULT_FILE}`")
