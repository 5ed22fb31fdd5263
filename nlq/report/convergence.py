"""Whether the runs had stopped improving: each arm's val-loss slope over the last 10% of its
steps, from the eval rows of metrics.jsonl (Run.evals).

Per run, a least-squares line through the evals in the last 10% of the steps (the last two
evals where that span holds fewer than two: the `small` preset evaluates every 200 of 2,000
steps, nlq/presets/small.toml) gives the slope per 1,000 steps and the fall over that span in
% of the final val loss; each arm's figures are means over its seeds. The criterion: an arm
whose val loss still fell by more than the half-width of the narrowest interval the report
judges with (the pre-registered comparisons and the positive control, else the paired
intervals against the baseline) is not converged: training longer could move its loss by
more than the intervals resolve, and the comparison is one of runs still on their way.
"""

from __future__ import annotations

import math

import numpy as np

from nlq.report.runs import Run

WINDOW = 0.10  # the last 10% of the steps


def run_slope(r: Run) -> dict | None:
    """Slope per 1,000 steps and fall over the span in % of the final val loss; None with
    fewer than two evals."""
    if len(r.evals) < 2:
        return None
    last = r.evals[-1][0]
    pts = [(s, v) for s, v in r.evals if s >= (1 - WINDOW) * last]
    if len(pts) < 2:
        pts = r.evals[-2:]
    steps, vals = np.array(pts, dtype=np.float64).T  # (k,), (k,)
    slope = float(np.polyfit(steps, vals, 1)[0])  # per step
    span = float(steps[-1] - steps[0])
    return {"slope_per_1k": 1000.0 * slope, "span_steps": span, "from_step": int(steps[0]),
            "fall_pct": -100.0 * slope * span / vals[-1]}


def convergence(by_arm: dict[str, list[Run]], half_width: float | None,
                judged_by: str | None) -> dict:
    """report.json's "convergence": per arm the mean slope and fall over its seeds, and
    whether each fell by more than half_width (% of log-loss) over the span."""
    arms = []
    for arm, runs in by_arm.items():
        fits = [f for f in map(run_slope, runs) if f is not None]
        row = {"arm": arm, "n_seeds": len(fits)}
        if fits:
            row |= {k: math.fsum(f[k] for f in fits) / len(fits)
                    for k in ("slope_per_1k", "fall_pct", "span_steps")}
            row["from_step"] = min(f["from_step"] for f in fits)
            row["converged"] = None if half_width is None else row["fall_pct"] <= half_width
        arms.append(row)
    still = [a["arm"] for a in arms if a.get("converged") is False]
    return {"window": WINDOW, "half_width_pct": half_width, "judged_by": judged_by,
            "arms": arms, "not_converged": still}


def convergence_text(conv: dict) -> str:
    """One sentence: converged or not by the criterion above."""
    h = conv["half_width_pct"]
    if h is None:
        return ("No interval to judge convergence by (one seed): the slopes are shown, "
                "without a verdict.")
    if conv["not_converged"]:
        falls = ", ".join(f"{a['arm']} {a['fall_pct']:.2f}%" for a in conv["arms"]
                          if a["arm"] in conv["not_converged"])
        return (f"The runs are not converged: over the last 10% of their steps the val loss "
                f"of {falls} still fell by more than the half-width of the narrowest judged "
                f"interval ({conv['judged_by']}, {h:.2f}%), so training longer could move "
                f"the losses by more than the intervals resolve.")
    return (f"Every arm's val loss fell by at most the half-width of the narrowest judged "
            f"interval ({conv['judged_by']}, {h:.2f}%) over the last 10% of its steps: by "
            f"this criterion the runs are converged.")
