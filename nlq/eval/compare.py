"""The comparisons an experiment pre-registers, and the positive control that must pass before
any of them gets a verdict.

Each comparison (arm vs against, paired by seed) gets: the mean relative difference in % of
the against arm's log-loss, the paired 95% t-interval over seeds, its half-width, the sd of
the per-seed differences, a two-level bootstrap interval over seeds and test documents
(nlq/eval/bootstrap.py), and, for the pre-registered ones, Holm's correction for their number:
the i-th smallest of m p-values is compared at 0.05 / (m - i + 1), and its interval is the
t-interval at that level. A verdict says "beats" or "worse" only where the Holm interval and
the bootstrap interval both exclude 0. The positive control (e.g. linear+12.5% vs linear, a
capacity check) must beat its baseline with both 95% intervals below 0; otherwise the report
says the setting cannot test the claim, and prints no verdict.
"""

from __future__ import annotations

import json

import numpy as np

from nlq.eval.bootstrap import paired_bootstrap
from nlq.eval.runs import Run
from nlq.eval.stats import LEVEL, mean_ci, paired
from nlq.extras import need


def _final(runs: list[Run]) -> dict:
    return {r.seed: r.final_loss for r in runs}


def _docs(runs: list[Run], seeds: list) -> np.ndarray | None:
    """(n, 2, D) nats and tokens per document of each seed's test_docs.json; None if any is
    missing or the documents differ."""
    by_seed = {r.seed: r for r in runs}
    out = []
    for s in seeds:
        try:
            d = json.loads((by_seed[s].dir / "test_docs.json").read_text())
            out.append([d["nats"], d["tokens"]])
        except (OSError, ValueError, KeyError, TypeError):  # missing, not JSON, not nlq's
            return None
    try:
        arr = np.asarray(out, dtype=np.float64)  # (n, 2, D)
    except (ValueError, TypeError):
        return None
    return arr if arr.ndim == 3 else None


def compare(arm: str, against: str, by_arm: dict[str, list[Run]], test: bool,
            level: float = LEVEL) -> dict:
    """One paired comparison: t-interval, sd, p-value and (on test) the bootstrap."""
    out = {"arm": arm, "against": against, "n_seeds": 0}
    if arm not in by_arm or against not in by_arm:
        out["problem"] = f"no finished run of {arm if arm not in by_arm else against}"
        return out
    pair = paired(_final(by_arm[arm]), _final(by_arm[against]))
    out["n_seeds"] = pair.n
    if pair.n < 2:
        out["problem"] = f"{pair.n} paired seed(s): an interval needs at least 2"
        if pair.n:
            out["mean_pct"] = pair.log_loss_pct[0]
        return out
    e = mean_ci(pair.log_loss_pct, level)
    sd = e.sd or 0.0
    tstat = e.mean / (sd / np.sqrt(pair.n)) if sd > 0 else np.inf * np.sign(e.mean)
    student_t = need("scipy.stats", "a paired t-test").t
    out |= {"mean_pct": e.mean, "ci95": [e.lo, e.hi], "half_width_95_pct": (e.hi - e.lo) / 2,
            "sd_pct": sd, "p": float(2 * student_t.sf(abs(tstat), pair.n - 1)),
            "per_seed_pct": pair.log_loss_pct, "seeds": pair.seeds}
    if test:
        a, b = _docs(by_arm[arm], pair.seeds), _docs(by_arm[against], pair.seeds)
        if a is not None and b is not None and a.shape == b.shape and np.array_equal(
                a[:, 1], b[:, 1]):
            out["bootstrap"] = paired_bootstrap(a[:, 0], b[:, 0], a[:, 1], level)
    return out


def holm(comps: list[dict], alpha: float = 1 - LEVEL) -> None:
    """Holm's step-down correction over the comparisons that have a p-value, in place:
    p_holm and the t-interval at the level of each one's step."""
    ok = sorted((c for c in comps if "p" in c), key=lambda c: c["p"])
    m, running = len(ok), 0.0
    for rank, c in enumerate(ok):
        running = max(running, min(1.0, (m - rank) * c["p"]))
        c["p_holm"] = running
        c["holm_level"] = 1.0 - alpha / (m - rank)
        e = mean_ci(c["per_seed_pct"], c["holm_level"])
        c["ci_holm"] = [e.lo, e.hi]


def passed(c: dict, key: str = "ci95") -> bool:
    """Both the t-interval (key) and, where there is one, the bootstrap lie below 0."""
    if key not in c:
        return False
    boot = c.get("bootstrap")
    return c[key][1] < 0 and (boot is None or boot["hi"] < 0)


def verdict(c: dict) -> str:
    """The sentence a pre-registered comparison earns, never more than its intervals say."""
    a, b = c["arm"], c["against"]
    if "problem" in c:
        return f"{a} vs {b}: no verdict ({c['problem']})"
    lo, hi = c["ci_holm"]
    boot = c.get("bootstrap")
    btxt = f"; bootstrap over seeds and test documents [{boot['lo']:+.2f}, {boot['hi']:+.2f}]" \
        if boot else ""
    nums = (f"{c['mean_pct']:+.2f}% log-loss, Holm-adjusted {100 * c['holm_level']:.1f}% "
            f"interval [{lo:+.2f}, {hi:+.2f}]{btxt}; {c['n_seeds']} seeds")
    if passed(c, "ci_holm"):
        return f"{a} beats {b}: {nums}"
    if lo > 0 and (boot is None or boot["lo"] > 0):
        return f"{a} is worse than {b}: {nums}"
    return f"no detectable difference between {a} and {b}: {nums}"


def control_line(c: dict) -> str:
    """The report's first line about the positive control."""
    a, b = c["arm"], c["against"]
    if "problem" in c:
        return (f"This setting cannot test the claim: the positive control ({a} vs {b}) could "
                f"not be evaluated ({c['problem']}).")
    boot = c.get("bootstrap")
    btxt = f", bootstrap [{boot['lo']:+.2f}, {boot['hi']:+.2f}]" if boot else ""
    nums = (f"{c['mean_pct']:+.2f}% log-loss, paired 95% CI [{c['ci95'][0]:+.2f}, "
            f"{c['ci95'][1]:+.2f}]{btxt}, {c['n_seeds']} seeds")
    if passed(c):
        return (f"Positive control passed: {a} beats {b} ({nums}), so this setting can test a "
                f"claim about capacity.")
    return (f"This setting cannot test the claim: more parameters ({a}) do not reliably beat "
            f"{b} here ({nums}).")
