"""The loss-vs-lr figure of a sweep: one panel per arm, each seed a point, the mean over seeds
a line, the chosen lr marked."""

from __future__ import annotations

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
        c = result["chosen"][arm]
        ax.axvline(c["lr"], color="0.5", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{arm}: chosen lr {c['lr']:.3g}", fontsize=10)
        ax.set_xlabel("peak lr")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"final val log-loss ({result['seeds']} seeds)")
    fig.suptitle(f"nlq sweep: {result['experiment']} on {result['preset']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
