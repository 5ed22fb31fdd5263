"""The recipe pilot's table (docs/experiments.md, 2026-12-04): for each recipe under
results/recipe-pilot/, on VAL (the pilot chooses a recipe; the test split is for verdicts):
each arm's mean final val log-loss; the paired nonlinear-vs-linear difference, its
seed-to-seed sd and its 95% half-width; the numerical-replicate spread (the same run at 2
threads instead of 1, in % of log-loss, RMS over the replicated runs); grad/loss spikes; the
val slope over the last 10% of steps; and the CPU-minutes the seed runs took.

Usage: .venv/bin/python scripts/recipe_pilot_table.py [results/recipe-pilot]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from nlq.report.convergence import run_slope
from nlq.report.runs import collect
from nlq.report.stats import mean_ci, paired


def rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else float("nan")


def recipe_row(folder: Path) -> dict:
    runs = [r for r in collect([folder]) if r.finished]
    prim = [r for r in runs if not r.replicate]
    reps = [r for r in runs if r.replicate]
    val = {(r.arm, r.seed): float(r.summary["val_loss"]) for r in prim}
    row = {"recipe": folder.name, "n": {}}
    for arm in ("linear", "nonlinear"):
        xs = [v for (a, _), v in val.items() if a == arm]
        row["n"][arm] = len(xs)
        row[arm] = sum(xs) / len(xs) if xs else float("nan")
    pair = paired({s: v for (a, s), v in val.items() if a == "nonlinear"},
                  {s: v for (a, s), v in val.items() if a == "linear"})
    e = mean_ci(pair.log_loss_pct)
    row |= {"diff_pct": e.mean, "sd_pct": e.sd, "half_width_pct": (e.hi - e.lo) / 2
            if e.hi is not None else float("nan"), "n_pairs": pair.n}
    rep_diffs, rep_pair = [], []
    for r in reps:
        v1 = val.get((r.arm, r.seed))
        if v1 is not None:
            rep_diffs.append(100 * (float(r.summary["val_loss"]) - v1) / v1)
    rv = {(r.arm, r.seed): float(r.summary["val_loss"]) for r in reps}
    for s in {s for (_, s) in rv}:
        if all((a, s) in rv and (a, s) in val for a in ("linear", "nonlinear")):
            d1 = 100 * (val[("nonlinear", s)] - val[("linear", s)]) / val[("linear", s)]
            d2 = 100 * (rv[("nonlinear", s)] - rv[("linear", s)]) / rv[("linear", s)]
            rep_pair.append(d2 - d1)
    row |= {"rep_run_rms_pct": rms(rep_diffs), "n_rep": len(rep_diffs),
            "rep_pair_rms_pct": rms(rep_pair),
            "spikes": sum(int(r.summary.get("n_spikes", 0)) for r in prim),
            "runs_with_spikes": sum(int(r.summary.get("n_spikes", 0)) > 0 for r in prim),
            "slope": {a: sum(run_slope(r)["slope_per_1k"] for r in prim if r.arm == a) /
                      max(1, sum(r.arm == a for r in prim)) for a in ("linear", "nonlinear")},
            "cpu_min": sum(float(r.summary.get("elapsed_s", 0)) * int(r.summary.get("threads", 1))
                           for r in prim) / 60,
            "isa": sorted({str(r.summary.get("isa")) for r in runs}),
            "cpu": sorted({str(r.summary.get("cpu")) for r in runs})}
    return row


def main(root: Path) -> None:
    rows = [recipe_row(d) for d in sorted(root.iterdir()) if (d / "runs").is_dir()]
    print("| recipe | linear val | nonlinear val | nonlinear vs linear (val) | sd of paired "
          "diff | 95% half-width | replicate: run RMS | replicate: paired-diff RMS | spikes "
          "(runs) | val slope /1k steps, last 10% (lin / nl) | CPU-min (seed runs) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['linear']:.4f} | {r['nonlinear']:.4f} | "
              f"{r['diff_pct']:+.2f}% ({r['n_pairs']} seeds) | {r['sd_pct']:.2f}% | "
              f"{r['half_width_pct']:.2f}% | {r['rep_run_rms_pct']:.3f}% ({r['n_rep']}) | "
              f"{r['rep_pair_rms_pct']:.3f}% | {r['spikes']} ({r['runs_with_spikes']}) | "
              f"{r['slope']['linear']:+.3f} / {r['slope']['nonlinear']:+.3f} | "
              f"{r['cpu_min']:.1f} |")
    isa = sorted({i for r in rows for i in r["isa"]})
    cpu = sorted({c for r in rows for c in r["cpu"]})
    print(f"\nISA: {', '.join(isa)}; CPU: {', '.join(cpu)}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/recipe-pilot"))
