"""The comparisons an experiment pre-registers, and the positive control that must pass before
any of them gets a verdict.

Each comparison (arm vs against, paired by seed) gets: the mean relative difference in % of
the against arm's log-loss, the paired 95% t-interval over seeds, its half-width, the sd of
the per-seed differences, a bootstrap interval over seeds and test units, drawn independently
(chunks of the test stream, or documents for runs that recorded none: nlq/report/bootstrap.py),
and, for the pre-registered ones, Holm's correction for their number: the i-th smallest of m
p-values is compared at 0.05 / (m - i + 1), and its interval is the t-interval at that level
(after the first comparison Holm cannot reject, at that comparison's level: see holm).

The pre-registered comparisons (the experiment's hypothesis.comparisons, nlq/report/claims.py)
are the Holm family and the only comparisons that get a verdict: every other statement of
the report about two arms is derived from their outcomes or is a description. A verdict
says "beats" or "worse" only where the Holm interval and the bootstrap interval both exclude
0. The positive control (e.g. linear+12.5% vs linear, a capacity check) is a gate, not a
finding: it must beat its baseline with both 95% intervals below 0; otherwise the report says
the setting cannot test the claim, and prints no verdict.
"""

from __future__ import annotations

import json

import numpy as np

from nlq import runfiles
from nlq.extras import need
from nlq.report.bootstrap import paired_bootstrap
from nlq.report.runs import Run, final
from nlq.report.stats import LEVEL, POWER, detectable, mean_ci, paired, seeds_for_power


def test_units(runs: list[Run]) -> tuple[list[np.ndarray] | None, str]:
    """Per run, (2, D) nats and tokens per test unit from its test_docs.json, and the unit:
    "chunks of <T> scored tokens" where every run recorded chunks of one size, else
    "documents"; None where a file is missing or not what nlq writes."""
    files = []
    for r in runs:
        try:
            files.append(json.loads((r.dir / runfiles.TEST_DOCS).read_text()))
        except (OSError, ValueError):  # missing, not JSON
            return None, "documents"
    sizes = {f.get("chunk_size") if isinstance(f, dict) else None for f in files}
    chunks = len(sizes) == 1 and None not in sizes
    keys = ("chunk_nats", "chunk_tokens") if chunks else ("nats", "tokens")
    unit = f"chunks of {sizes.pop()} scored tokens" if chunks else "documents"
    try:
        arrs = [np.asarray([f[keys[0]], f[keys[1]]], dtype=np.float64) for f in files]
    except (KeyError, TypeError, ValueError):  # not nlq's
        return None, unit
    return (arrs if all(a.ndim == 2 for a in arrs) else None), unit


def compare(arm: str, against: str, by_arm: dict[str, list[Run]], test: bool,
            level: float = LEVEL) -> dict:
    """One paired comparison: t-interval, sd, p-value and (on test) the bootstrap."""
    out = {"arm": arm, "against": against, "n_seeds": 0}
    if arm not in by_arm or against not in by_arm:
        out["problem"] = f"no finished run of {arm if arm not in by_arm else against}"
        out["absent"] = True  # an arm not run (or none of its runs finished): outside Holm's m
        return out
    pair = paired(final(by_arm[arm]), final(by_arm[against]))
    out["n_seeds"] = pair.n
    if pair.only_arm or pair.only_base:  # a seed finished in one arm only: not in the pair
        out["unpaired"] = {arm: pair.only_arm, against: pair.only_base}
    if pair.n < 2:
        out["problem"] = f"{pair.n} paired seed(s): an interval needs at least 2"
        if pair.n:
            out["mean_pct"] = pair.log_loss_pct[0]
        return out
    e = mean_ci(pair.log_loss_pct, level)
    sd = e.sd or 0.0
    if not sd > 0:  # e.g. bit-identical arms: a t-test of 0/0 has no p (NaN would upset Holm)
        out["problem"] = (f"the {pair.n} per-seed differences are all equal "
                          f"({e.mean:+.3g}%): no t-test")
        out["mean_pct"] = e.mean
        return out
    tstat = e.mean / (sd / np.sqrt(pair.n))
    student_t = need("scipy.stats", "a paired t-test").t
    out |= {"mean_pct": e.mean, "ci95": [e.lo, e.hi], "half_width_95_pct": (e.hi - e.lo) / 2,
            "sd_pct": sd, "p": float(2 * student_t.sf(abs(tstat), pair.n - 1)),
            # planning, not judging: the smallest true difference these seeds find with 80%
            # power at the 95% level (Holm's stricter level would need more)
            "detectable_80_pct": detectable(sd, pair.n),
            "per_seed_pct": pair.log_loss_pct, "seeds": pair.seeds}
    if test:
        runs = [_by_seed(by_arm[x])[s] for x in (arm, against) for s in pair.seeds]
        units, unit = test_units(runs)
        try:
            a, b = np.stack(units[:pair.n]), np.stack(units[pair.n:])  # (n, 2, D) each
        except (TypeError, ValueError):  # a file missing, or units that differ between runs
            a = b = None
        if a is not None and a.shape == b.shape and np.array_equal(a[:, 1], b[:, 1]):
            out["bootstrap"] = paired_bootstrap(a[:, 0], b[:, 0], a[:, 1], level) | {
                "unit": unit, "n_units": a.shape[2]}
    return out


def _by_seed(runs: list[Run]) -> dict:
    return {r.seed: r for r in runs}


def judge(control_pair: tuple[str, str] | None, pairs, by_arm: dict[str, list[Run]],
          test: bool) -> tuple[dict | None, list[dict]]:
    """The positive control and the pre-registered comparisons of by_arm, Holm-corrected
    together: what the report's verdicts are read from."""
    control = compare(*control_pair, by_arm, test) if control_pair else None
    comps = [compare(a, against, by_arm, test) for a, against in pairs]
    holm(comps)
    return control, comps


def holm(comps: list[dict], alpha: float = 1 - LEVEL) -> None:
    """Holm's step-down correction over the comparisons that have a p-value, in place:
    p_holm and the t-interval at the level of each one's step.

    The step-down stops at the first comparison it cannot reject, and none after it is
    rejected, however small its own p: from that step on every interval is the one at the
    stopping step's level (Bonferroni over the comparisons not rejected, as in the intervals
    compatible with Holm's test, Strassburger & Bretz 2008), so an interval excludes 0 only
    where p_holm < alpha. (At its own step's level, the comparison after a step i that
    failed, with p between alpha / (m - i + 1) and alpha / (m - i), would get a verdict its
    p_holm denies.) A comparison of two arms that have runs but no t-test (fewer than 2
    paired seeds, differences all equal) still counts in m, as pre-registered; one whose arm
    has no finished run (an arm left out of the command) does not."""
    ok = sorted((c for c in comps if "p" in c), key=lambda c: c["p"])
    m, running, stop = sum(not c.get("absent") for c in comps), 0.0, None
    for rank, c in enumerate(ok):
        running = max(running, min(1.0, (m - rank) * c["p"]))
        c["p_holm"] = running
        if stop is None and running >= alpha:
            stop = rank
        c["holm_level"] = 1.0 - alpha / (m - (rank if stop is None else stop))
        e = mean_ci(c["per_seed_pct"], c["holm_level"])
        c["ci_holm"] = [e.lo, e.hi]


def passed(c: dict, key: str = "ci95") -> bool:
    """Both the t-interval (key) and, where there is one, the bootstrap lie below 0."""
    if key not in c:
        return False
    boot = c.get("bootstrap")
    return c[key][1] < 0 and (boot is None or boot["hi"] < 0)


def outcome(c: dict) -> str:
    """A pre-registered comparison's outcome: "beats", "worse", "none" (no detectable
    difference) or "no verdict" (it could not be computed)."""
    if "problem" in c:
        return "no verdict"
    boot = c.get("bootstrap")
    if passed(c, "ci_holm"):
        return "beats"
    if c["ci_holm"][0] > 0 and (boot is None or boot["lo"] > 0):
        return "worse"
    return "none"


def numbers(c: dict) -> str:
    """A pre-registered comparison's mean, Holm interval and bootstrap, in one phrase."""
    lo, hi = c["ci_holm"]
    boot = c.get("bootstrap")
    btxt = (f"; bootstrap over seeds and test {_unit_name(boot)} [{boot['lo']:+.2f}, "
            f"{boot['hi']:+.2f}]") if boot else ""
    return (f"{c['mean_pct']:+.2f}% log-loss, Holm-adjusted {100 * c['holm_level']:.1f}% "
            f"interval [{lo:+.2f}, {hi:+.2f}]{btxt}; {c['n_seeds']} seeds")


def _unit_name(boot: dict) -> str:
    return "chunks" if boot.get("unit", "documents").startswith("chunks") else "documents"


def verdict(c: dict) -> str:
    """The sentence a pre-registered comparison earns, never more than its intervals say."""
    a, b = c["arm"], c["against"]
    o = outcome(c)
    if o == "no verdict":
        return f"{a} vs {b}: no verdict ({c['problem']})"
    head = {"beats": f"{a} beats {b}", "worse": f"{a} is worse than {b}",
            "none": f"no detectable difference between {a} and {b}"}[o]
    return f"{head}: {numbers(c)}"


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
            f"{b} here ({nums}).{_power_note(c)}")


def _power_note(c: dict) -> str:
    """For a control that failed with its mean on the expected side: what its seeds could
    detect, and how many seeds a true effect of its mean size would need (80% power). A
    figure for planning a new design: adding seeds to this one after seeing it would bias it."""
    mde, mean, sd = c.get("detectable_80_pct"), c.get("mean_pct"), c.get("sd_pct")
    if mde is None or mean is None or not mean < 0 or not sd:
        return ""
    need_n = seeds_for_power(mean, sd)
    more = (f"; an effect of its mean size ({abs(mean):.2f}%) needs ~{need_n} seeds"
            if need_n else "")
    return (f" With its paired sd ({sd:.2f}%), {c['n_seeds']} seeds detect a difference of "
            f"{mde:.2f}% with {POWER:.0%} power{more} (for planning a new design).")
