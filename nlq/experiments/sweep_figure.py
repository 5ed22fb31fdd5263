"""The loss-vs-lr figure of a sweep: one panel per arm, each seed a point, the mean over seeds
a line, the quadratic fitted in log(lr) dashed over the points it used (nlq/experiments/
sweep.py, fit_lr), the chosen lr marked."""

from __future__ import annotations

import math
from pathlib import Path

from nlq.extras import need


def draw_sweep(result: dict, path: Path) -> None:
    FigureCanvasAgg = need("matplotlib.backends.backend_agg", "a figure").FigureCanvasAgg
    from matplotlib.figure import Figure

    arms = list(result["results"])
    fig = Figure(figsize=(4 * len(arms), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(arms), sharey=True, squeeze=False)[0]
    for ax, arm, color in zip(axes, arms, (f"C{i % 10}" for i in range(len(arms)))):
        by_lr = result["results"][arm]
        lrs = sorted(float(k) for k in by_lr)
        for lr in lrs:
            vals = by_lr[repr(lr)]
            ax.scatter([lr] * len(vals), vals, s=14, color=color, alpha=0.7)
        ax.plot(lrs, [sum(by_lr[repr(lr)]) / len(by_lr[repr(lr)]) for lr in lrs], color=color)
        fit = result["fit"][arm]
        a, b, c = fit["coef"]
        lo, hi = math.log(fit["lrs"][0]), math.log(fit["lrs"][-1])
        xs = [lo + (hi - lo) * i / 40 for i in range(41)]
        ax.plot([math.exp(x) for x in xs], [a * x * x + b * x + c for x in xs], color="0.3",
                ls="--", lw=1, label="fit" if fit["used"] else "fit (not used)")
        ch = result["chosen"][arm]
        ax.axvline(ch["lr"], color="0.5", ls=":", lw=1)
        if fit["used"]:
            ax.scatter([ch["lr"]], [fit["vertex_loss"]], marker="*", s=60, color="k", zorder=3)
        ax.set_xscale("log", base=2)
        how = "fit" if ch["by"] == "fit" else "grid"
        ax.set_title(f"{arm}: chosen lr {ch['lr']:.3g} ({how})", fontsize=10)
        ax.set_xlabel("peak lr")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"final val log-loss ({result['seeds']} seeds)")
    fig.suptitle(f"nlq sweep: {result['experiment']} on {result['preset']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
