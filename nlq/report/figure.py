"""Fig. 1 as the paper draws it (docs/paper.md, "The paper's numbers"): top, val log-loss
against steps per arm; bottom, improvement over the baseline in % against steps (positive =
lower loss than the baseline); below, the reference figures the experiment declares. Primary
runs only: numerical replicates are no seeds (nlq/report/runs.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from nlq.extras import need
from nlq.report.runs import Run


def _curve(runs: list[Run], value) -> tuple[list[int], list[list[float]]]:
    """Steps logged by every run, and per step the values value(run, step) over runs."""
    tables = [dict(r.evals) for r in runs if r.evals]
    if not tables:
        return [], []
    steps = sorted(set.intersection(*(set(t) for t in tables)))
    return steps, [[value(t, s) for t in tables] for s in steps]


def draw_fig1(runs: list[Run], rep: dict, path: Path) -> None:
    """Fig. 1 drawn straight onto an Agg canvas: no pyplot, so no global backend change."""
    FigureCanvasAgg = need("matplotlib.backends.backend_agg", "a figure").FigureCanvasAgg
    from matplotlib.figure import Figure

    base = rep["baseline"]
    by_arm: dict[str, list[Run]] = {}
    for r in runs:
        if r.finished and not r.replicate:  # seeds only: a replicate is no seed (nlq/report/runs.py)
            by_arm.setdefault(r.arm, []).append(r)
    arms = [row["arm"] for row in rep["arms"]]
    fig = Figure(figsize=(8, 8.5))
    FigureCanvasAgg(fig)
    top, bot = fig.subplots(2, 1, sharex=True)
    colors = [f"C{i % 10}" for i in range(len(arms))]
    late_top, late_bot, last = [], [], 0

    for arm, color in zip(arms, colors):
        steps, vals = _curve(by_arm[arm], lambda t, s: t[s])
        if not steps:
            continue
        last = max(last, steps[-1])
        mean = [sum(v) / len(v) for v in vals]
        n = len(vals[0])
        top.plot(steps, mean, color=color, label=f"{arm} ({n} seed{'s' if n > 1 else ''})")
        if n > 1:
            top.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals],
                             color=color, alpha=0.2, linewidth=0)
        late_top.append((steps, [min(v) for v in vals], [max(v) for v in vals]))

        if base is None or arm == base:
            continue
        base_by_seed = {r.seed: dict(r.evals) for r in by_arm[base] if r.evals}
        pairs = [(dict(r.evals), base_by_seed[r.seed]) for r in by_arm[arm]
                 if r.evals and r.seed in base_by_seed]
        if not pairs:
            continue
        common = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs)))
        imp = [[100.0 * (b[s] - a[s]) / b[s] for a, b in pairs] for s in common]
        bot.plot(common, [sum(v) / len(v) for v in imp], color=color,
                 label=f"{arm} ({len(pairs)} paired seed{'s' if len(pairs) > 1 else ''})")
        if len(pairs) > 1:
            bot.fill_between(common, [min(v) for v in imp], [max(v) for v in imp],
                             color=color, alpha=0.2, linewidth=0)
        late_bot.append((common, [min(v) for v in imp], [max(v) for v in imp]))

    # The first evals (loss near ln(vocab)) would flatten every later difference: scale the
    # y-axes to the last 80% of training; the lines themselves are drawn in full.
    for ax, curves in ((top, late_top), (bot, late_bot)):
        lo = [x for st, mn, _ in curves for s, x in zip(st, mn) if s >= 0.2 * last]
        hi = [x for st, _, mx in curves for s, x in zip(st, mx) if s >= 0.2 * last]
        if ax is bot:
            lo, hi = lo + [0.0], hi + [0.0]
        if lo and hi:
            pad = 0.08 * (max(hi) - min(lo) or 1.0)
            ax.set_ylim(min(lo) - pad, max(hi) + pad)
    bot.axhline(0.0, color="0.4", linewidth=0.8)
    top.set_ylabel("validation log-loss (nats/token)")
    top.set_title("validation log-loss (mean over seeds; band: min..max)", fontsize=10)
    bot.set_ylabel(f"improvement over {base} (%)\n100·(L_base − L_arm)/L_base, > 0 = better"
                   if base else "no baseline")
    bot.set_title("improvement over the baseline, paired by seed (mean; band: min..max)",
                  fontsize=10)
    bot.set_xlabel("optimizer step")
    for ax in (top, bot):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(rep["title"])
    caption = _caption(rep["paper"]) if rep["paper"] else []
    if caption:
        fig.text(0.01, 0.005, "\n".join(caption), fontsize=7.5, va="bottom", color="0.25")
    # about 0.018 of the figure's height per caption line at 7.5 pt
    fig.tight_layout(rect=(0, 0.018 * len(caption) + 0.006 * bool(caption), 1, 1))
    fig.savefig(path, dpi=120)


def _caption(p: dict) -> list[str]:
    """The declared reference figures (nlq.report.claims) as changes vs the paper's baseline,
    one line per version: the numbers of report.md's table."""
    by_version: dict[str, list[str]] = {}
    for e in p["figures"]:
        parts = [f"{e[k]:+.2f}% {what}" for k, what in (("log_loss_pct", "log-loss"),
                                                         ("ppl_pct", "perplexity")) if k in e]
        if parts:
            by_version.setdefault(e["version"], []).append(f"{e['arm']} {', '.join(parts)}")
    lines = textwrap.wrap(f"Paper, another scale: {p['cite']}; {p['setting']}.", 150)
    for version, items in by_version.items():
        lines += textwrap.wrap(f"{version}: " + "; ".join(items) + ".", 150)
    return lines
