"""`nlq sweep`: tune every arm's lr alike, on val, before the seed runs.

Every arm trains at every lr of one grid (constant x2 or x sqrt(2) steps, at least 3 values)
for the same seeds, each run an ordinary `nlq train` run dir under
OUT/runs/lr<lr>/<arm>/seed<k>/; min_lr keeps the preset's min_lr / lr ratio.

The sweep's seeds are not the comparison's: seed index k means init seed train.seed + k and
data order data.seed + k, as in `nlq reproduce`, whose seeds are 0..N-1; a sweep's are
SEED_OFFSET + 0..n-1. The runs that choose the lrs therefore never reappear among the runs
that are compared at those lrs (a choice evaluated on its own seeds is biased toward it).

Each arm's lr is chosen on final VAL loss (the test split is never looked at) from the mean
over seeds: a quadratic in log(lr) is fitted to the grid points within x2 of the lowest one
(at least 3), and its vertex is chosen when the parabola is convex and the vertex lies inside
the points fitted; otherwise the lowest grid point is. A 2-seed argmin over a x2 grid picked
lrs on gaps of 0.01 nats that the seeds disagreed on (docs/experiments.md, 2026-12-04); the
fit uses the neighbours' losses too. Besides the choice, sweep.json holds the paired
difference of every arm vs the baseline at each lr of the grid (the same lr for both), so a
reader sees whether a gap depends on the lrs chosen. Written with the commit that chose it to
OUT/sweep.json, with the loss-vs-lr figure OUT/sweep.png. `nlq reproduce --lrs-from
OUT/sweep.json` then runs the seeds at those lrs, so the baseline gets exactly the tuning the
variant gets.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from nlq import runfiles
from nlq.errors import NlqError
from nlq.experiments.experiment import load_experiment
from nlq.experiments.plan import RunSpec, check_out, resolve_jobs, run_states
from nlq.experiments.reproduce import ensure_data, plan
from nlq.experiments.runner import run_all
from nlq.fsutil import write_atomic
from nlq.runfiles import read_summary

PLAN_FILE, RESULT_FILE, FIGURE_FILE = "sweep-plan.json", "sweep.json", "sweep.png"
SEED_OFFSET = 1000  # a sweep's seed indices start here: reproduce's seeds 0..N-1 stay unseen
STEPS = {"x2": 2.0, "x sqrt(2)": math.sqrt(2.0)}  # the grid steps a sweep accepts
STEP_TOL = 1e-3  # relative: 1.414e-2 after 1e-2 is a x sqrt(2) step as typed
LR_CHOICE = "vertex of a quadratic in log(lr) fitted within x2 of the lowest mean"


def check_grid(lrs: list[float], key: str = "--lrs") -> list[float]:
    """At least 3 finite positive values rising in one constant step, x2 or x sqrt(2)."""
    for v in lrs:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                math.isfinite(v) and v > 0):
            raise NlqError(f"{key}: {v!r} is not a positive finite learning rate")
    if len(lrs) < 3:
        raise NlqError(f"{key} needs at least 3 values (x2 or x sqrt(2) steps), got {len(lrs)}")
    step = grid_step(lrs[:2], key)
    for a, b in itertools.pairwise(lrs):
        if abs(b / a / step - 1.0) > STEP_TOL:
            raise NlqError(f"{key} must rise in one constant step, x2 or x sqrt(2): {b!r} after "
                           f"{a!r} is x{b / a:.4g}, the first step x{step:.4g}")
    return lrs


def grid_step(lrs: list[float], key: str = "--lrs") -> float:
    """The exact step (2 or sqrt(2)) of a grid whose first two values are that step apart."""
    r = lrs[1] / lrs[0]
    for step in STEPS.values():
        if abs(r / step - 1.0) <= STEP_TOL:
            return step
    raise NlqError(f"{key} must rise in one constant step, x2 or x sqrt(2): {lrs[1]!r} after "
                   f"{lrs[0]!r} is x{r:.4g}")


def lr_tag(lr: float) -> str:
    return f"lr{lr:.4g}"


def sweep_plan(experiment: str, preset: str, arms: list[str] | None, lrs: list[float],
               seeds: int, out: Path, sets: dict | None,
               threads: int = 1) -> tuple[list[RunSpec], dict]:
    check_grid(lrs)
    fixed = sorted({"train.lr", "train.min_lr"} & set(sets or {}))
    if fixed:  # the grid sets both: a --set value would be silently replaced
        raise NlqError(f"--set {fixed[0]}: a sweep sets the lr from --lrs (and min_lr keeps its "
                       f"ratio to lr): leave it out")
    if seeds < 2:
        raise NlqError(f"--seeds must be >= 2 for a sweep (the choice averages over seeds), "
                       f"got {seeds}")
    exp = load_experiment(experiment)
    base = plan(exp, preset, seeds, arms, out, sets, threads)

    def swept(s: RunSpec, lr: float):
        ratio = s.cfg.train.min_lr / s.cfg.train.lr
        # the test split is never looked at while choosing: not even computed
        return s.cfg.replace(**{"train.lr": lr, "train.min_lr": lr * ratio,
                                "train.test_eval": False,
                                "train.seed": s.cfg.train.seed + SEED_OFFSET,
                                "data.seed": s.cfg.data.seed + SEED_OFFSET})

    # an arm that differs from another only by its lr_scale is that arm once the lr is swept
    firsts: dict[str, object] = {}
    for s in (s for s in base if s.seed_index == 0 and not s.replicate):
        cfg = swept(s, lrs[0])
        same = next((a for a, c in firsts.items() if c == cfg), None)
        if same is not None:
            raise NlqError(f"arms {same!r} and {s.arm!r} are the same config once a sweep sets "
                           f"the lr (they differ at most in it: an arm's lr_scale only scales "
                           f"the lr the sweep chooses): list one of them in --arms")
        firsts[s.arm] = cfg
    specs = []
    for lr in lrs:
        for s in base:
            k = SEED_OFFSET + s.seed_index
            specs.append(replace(s, cfg=swept(s, lr), seed_index=k, tag=f"{lr_tag(lr)}-",
                                 run_dir=out / "runs" / lr_tag(lr) / s.arm / f"seed{k}"))
    meta = {"experiment": exp.name, "preset": preset, "arms": sorted({s.arm for s in base}),
            "grid": lrs, "seeds": seeds, "seed_indices": [SEED_OFFSET + k for k in range(seeds)],
            "lr_choice": LR_CHOICE, "baseline": exp.baseline,
            "sets": {k: sets[k] for k in sorted(sets or {})}, "threads": threads}
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


def fit_lr(lrs: list[float], means: list[float]) -> dict:
    """The lr at the minimum of the seed-mean val loss over an increasing grid: a least-squares
    quadratic loss = a x^2 + b x + c in x = ln(lr), fitted to the grid points within x2 of the
    lowest mean (3 on a x2 grid, 5 on a x sqrt(2) one; at least 3, moved inward at an edge).
    Its vertex is the choice when a > 0 and the vertex lies within the fitted points; else
    the lowest grid point. The lr is rounded to 3 significant digits (and kept within the
    fitted points): far finer than a fit over a few seeds resolves, and its last bits would
    depend on the LAPACK that fitted it."""
    import numpy as np

    n = len(lrs)
    i = min(range(n), key=lambda j: (means[j], lrs[j]))
    w = round(math.log(2.0) / math.log(grid_step(lrs)))  # grid points per x2
    lo, hi = max(0, i - w), min(n - 1, i + w)
    # at an edge that leaves 2 points on a x2 grid: widen inward to 3
    lo, hi = min(lo, max(0, hi - 2)), max(hi, min(n - 1, lo + 2))
    xs = [math.log(v) for v in lrs[lo:hi + 1]]
    a, b, c = (float(v) for v in np.polyfit(xs, means[lo:hi + 1], 2))
    x_v = -b / (2 * a) if a > 0 else None
    used = x_v is not None and xs[0] <= x_v <= xs[-1]
    return {"lrs": lrs[lo:hi + 1], "coef": [a, b, c],
            "vertex_lr": math.exp(x_v) if x_v is not None else None,
            "vertex_loss": c - b * b / (4 * a) if x_v is not None else None,
            "used": used, "grid_best": lrs[i], "grid_best_loss": means[i],
            # rounded, then kept within the fitted points (rounding may step past the edge)
            "lr": min(max(float(f"{math.exp(x_v):.3g}"), lrs[lo]), lrs[hi]) if used
            else lrs[i]}


def choose(specs: list[RunSpec], meta: dict) -> dict:
    """sweep.json's content from the finished runs: final val loss per arm, lr and seed; each
    arm's lr (fit_lr); each arm vs the baseline at every lr of the grid (matched)."""
    by_seed: dict[str, dict[str, dict[int, float]]] = {}
    for s in specs:
        summary, why = read_summary(s.run_dir)
        loss = summary.get("val_loss") if summary else None
        if not isinstance(loss, (int, float)) or isinstance(loss, bool):
            raise NlqError(f"{s.run_dir / runfiles.SUMMARY} "
                           f"{why or f'has no numeric val_loss (val_loss = {loss!r})'}: no lr "
                           f"is chosen from it; remove {s.run_dir} to train it again")
        by_seed.setdefault(s.arm, {}).setdefault(repr(s.cfg.train.lr), {})[s.seed_index] = loss
    # results[arm][lr]: the losses in the order of meta["seed_indices"]
    results = {arm: {lr: [v[k] for k in sorted(v)] for lr, v in by_lr.items()}
               for arm, by_lr in by_seed.items()}
    chosen, edge, fits = {}, {}, {}
    for arm, by_lr in results.items():
        lrs = sorted(float(lr) for lr in by_lr)
        means = [sum(by_lr[repr(lr)]) / len(by_lr[repr(lr)]) for lr in lrs]
        fit = fit_lr(lrs, means)
        fits[arm] = fit
        chosen[arm] = {"lr": fit["lr"], "by": "fit" if fit["used"] else "grid",
                       "val_loss": fit["vertex_loss"] if fit["used"] else fit["grid_best_loss"]}
        edge[arm] = fit["grid_best"] in (lrs[0], lrs[-1])
    sha, dirty = source_commit()
    return {**meta, "commit": sha, "dirty": dirty, "metric": "val_loss",
            "results": results, "chosen": chosen, "edge": edge, "fit": fits,
            "matched": matched(by_seed, meta["baseline"])}


def matched(by_seed: dict, baseline: str) -> dict:
    """matched[arm][lr]: the arm vs the baseline, both at that lr: the paired difference of
    final val log-loss in % of the baseline's, over the sweep's seeds, with its paired 95%
    t-interval (nlq/report/stats.py, as the report computes it on test)."""
    from nlq.report.stats import paired

    out: dict[str, dict[str, dict]] = {}
    for arm, by_lr in by_seed.items():
        if arm == baseline:
            continue
        for lr, losses in by_lr.items():
            e = paired(losses, by_seed[baseline][lr]).log_loss()
            out.setdefault(arm, {})[lr] = {"mean_pct": e.mean, "lo": e.lo, "hi": e.hi, "n": e.n}
    return out


def sweep(experiment: str, preset: str, arms: list[str] | None, lrs: list[float], seeds: int,
          out: Path, jobs: int, sets: dict | None = None, threads: int = 1,
          launcher: str = "local", stack: int = 1, after_run=None) -> int:
    """after_run(run_dir): called as each run finishes (runner.run_all)."""
    from nlq.experiments.sweep_figure import draw_sweep

    check_out(out, "sweep")  # a folder of the user's is refused before any work
    specs, meta = sweep_plan(experiment, preset, arms, lrs, seeds, out, sets, threads)
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
    states = run_states(specs, "sweep", stack)  # another config's run dir: refused, no write
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(plan_path, json.dumps(meta, indent=2))
    (out / "configs").mkdir(exist_ok=True)
    for s in specs:
        write_atomic(out / "configs" / s.config_name, s.cfg.to_toml())
    ensure_data(preset, specs[0].cfg)
    jobs = resolve_jobs(jobs, specs, launcher, "sweep", stack)  # auto on a GPU: from memory
    failed = run_all(specs, load_experiment(experiment), jobs, out, states, launcher, "sweep",
                     stack, after_run)
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
    print(f"sweep: final val loss, mean over {result['seeds']} seeds (indices "
          f"{result['seed_indices'][0]}..{result['seed_indices'][-1]}: none of them a seed of "
          f"`nlq reproduce`; {result['preset']} preset, commit "
          f"{(result['commit'] or 'unknown')[:10]}{', dirty' if result['dirty'] else ''})")
    print("| arm | " + " | ".join(f"lr {lr:.3g}" for lr in grid) + " | chosen |")
    print("|---|" + "---|" * (len(grid) + 1))
    for arm, by_lr in result["results"].items():
        cells = [sum(by_lr[repr(lr)]) / len(by_lr[repr(lr)]) for lr in grid]
        c = result["chosen"][arm]
        how = "fit" if c["by"] == "fit" else "lowest grid point"
        flag = " (edge of the grid: widen it)" if result["edge"][arm] else ""
        print(f"| {arm} | " + " | ".join(f"{v:.4f}" for v in cells) +
              f" | {c['lr']:.3g} ({how}){flag} |")
    base = result["baseline"]
    # the grid lr nearest the baseline's choice: both arms at the same lr, so the gap there
    # does not depend on which lr each arm was given
    at = min(grid, key=lambda lr: abs(math.log(lr / result["chosen"][base]["lr"])))
    for arm, by_lr in result["matched"].items():
        m = by_lr[repr(at)]
        ci = f" [{m['lo']:+.2f}, {m['hi']:+.2f}]" if m["lo"] is not None else ""
        print(f"at lr {at:.3g} for both (nearest {base}'s choice): {arm} vs {base} "
              f"{m['mean_pct']:+.2f}%{ci} val log-loss, paired over {m['n']} seeds")
    print(f"wrote {out / RESULT_FILE}, {out / FIGURE_FILE}; use them with "
          f"`nlq reproduce --lrs-from {out / RESULT_FILE}`")
