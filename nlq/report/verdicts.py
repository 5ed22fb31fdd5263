"""The verdicts report.json reads from the Holm family's outcomes, and the sentences that
describe a comparison without one (nlq.report.summary puts them in the report).

A pair of arms outside the pre-registered comparisons (nlq.report.claims, nlq.report.compare) and
the positive control is described, never judged (describe). The declared ordering holds or
fails only where each neighbouring pair has an outcome (ordering); a nonlinear gain
"survives" a QK-norm baseline only where both of its pairs have one (strong_baseline); a
verdict that changes with the summation order (nlq.report.noise) is given as no finding
(stable_verdict). The number formats here are those of every sentence and table cell.
"""

from __future__ import annotations

from itertools import pairwise

from nlq.report.claims import Claims
from nlq.report.compare import numbers, outcome
from nlq.report.compare import verdict as prereg_verdict
from nlq.report.noise import OUTCOME_WORDS
from nlq.report.runs import Run, final
from nlq.report.stats import Estimate, Paired, paired


def fmt_pct(x: float) -> str:
    return f"{abs(x):.2f}" if abs(x) >= 0.05 else f"{abs(x):.2g}"


def fmt_signed(x: float) -> str:
    return f"{x:+.2f}" if abs(x) >= 0.05 or x == 0 else f"{x:+.2g}"


def ci_text(e: Estimate) -> str:
    return f"{fmt_signed(e.lo)}..{fmt_signed(e.hi)}%"


def describe(base: str, pair: Paired, outside: bool = True) -> str:
    """The numbers of a paired comparison, with no verdict and no "beats"; outside: say it
    is outside the Holm family."""
    if pair.n == 0:
        return f"no seed in common with {base}, so no paired comparison"
    e = pair.log_loss()
    side = "below" if e.mean < 0 else "above"
    if pair.n == 1:
        return (f"1 seed: no interval, a single observation (log-loss "
                f"{fmt_pct(e.mean)}% {side} {base})")
    note = " (described: not a pre-registered comparison)" if outside else ""
    return (f"mean log-loss {fmt_signed(e.mean)}% vs {base}, paired 95% CI {ci_text(e)}, "
            f"{pair.n} seeds{note}")


NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def ordering(rows: dict[str, dict], by_arm: dict[str, list[Run]], claims: Claims,
             outcomes: dict[tuple[str, str], str]) -> dict | None:
    """The declared ordering (claims.ordering, lowest final log-loss first); None if none
    declared. It holds when every neighbouring pair has the outcome "beats" and fails when
    one is "worse" (outcomes: the Holm family's, and the passed positive control's); with a
    pair outside them it is only described, with the paired 95% intervals."""
    order = list(claims.ordering)
    if not order:
        return None
    who = "The paper's ordering" if claims.reference else "The declared ordering"
    chain = " < ".join(order)
    missing = [a for a in order if a not in rows]
    if missing:
        return {"testable": False, "arms": order,
                "answer": f"{who} {chain} cannot be checked here: no {' and no '.join(missing)} "
                          f"arm among the finished runs."}
    means = {a: rows[a]["loss"]["mean"] for a in order}
    holds = all(means[x] < means[y] for x, y in pairwise(order))
    pairs = {f"{x} vs {y}": paired(final(by_arm[x]), final(by_arm[y]))
             for x, y in pairwise(order)}
    ests = {k: p.log_loss() for k, p in pairs.items()}
    got = {f"{x} vs {y}": outcomes.get((x, y)) for x, y in pairwise(order)}
    order_txt = " < ".join(f"{a} {means[a]:.4f}" for a in sorted(means, key=means.get))
    ranked = f"Mean final log-loss ranks them {order_txt}. "
    parts = [f"{k} {fmt_signed(e.mean)}% (paired 95% CI {ci_text(e)})"
             for k, e in ests.items() if e is not None and e.has_interval]
    intervals = ("Intervals: " + "; ".join(parts) + ".") if parts else ""
    separated = bool(parts) and len(parts) == len(ests) and all(
        e.hi < 0 for e in ests.values())
    n = NUMBER_WORDS.get(len(order), str(len(order)))
    outside = [k for k, o in got.items() if o is None]
    if outside:
        status = "described"
        ans = (f"{who} {chain} is described, not judged: {' and '.join(outside)} "
               f"{'is' if len(outside) == 1 else 'are'} not a pre-registered comparison. ")
    elif any(o == "no verdict" for o in got.values()):
        status = "untested"
        ans = f"{who} {chain} is not tested here: a comparison of its arms has no verdict. "
    elif all(o == "beats" for o in got.values()):
        status = "holds"
        ans = (f"{who} {chain} holds here: the intervals separate the {n} arms (the "
               f"pre-registered comparisons' and the positive control's). ")
    elif any(o == "worse" for o in got.values()):
        status = "contradicted"
        against = [k for k, o in got.items() if o == "worse"]
        ans = (f"{who} {chain} does not hold here: the interval of {' and '.join(against)} "
               f"lies above 0. ")
    else:
        status = "unresolved"
        ans = (f"{who} {chain} is neither confirmed nor contradicted here: the intervals "
               f"do not separate all {n} arms. ")
    return {"testable": status not in ("described", "untested"), "arms": order,
            "means": means, "holds_in_means": holds, "separated_by_intervals": separated,
            "status": status, "outcomes": got,
            "paired": {k: p.to_dict() for k, p in pairs.items()},
            "answer": ans + ranked + intervals}


def strong_baseline(rows: dict[str, dict], by_arm: dict[str, list[Run]], baseline: str,
                    outcomes: dict[tuple[str, str], str],
                    family: set[tuple[str, str]]) -> list[dict]:
    """For each QK-norm linear arm: does each nonlinear arm's gain survive against it? A
    verdict only where both (nonlinear, baseline) and (nonlinear, QK-norm arm) are in the
    Holm family (family: its pairs; outcomes: their outcomes, empty when no verdict is
    allowed), and only a gain shown over the baseline ("beats") can survive; otherwise the
    pair is described, saying why."""
    strong = [a for a, r in rows.items() if r["qk_norm"] and r["query"] == "linear"]
    nonlin = [a for a, r in rows.items() if r["query"] == "nonlinear"]
    out = []
    for s in strong:
        for n in nonlin:
            pair = paired(final(by_arm[n]), final(by_arm[s]))
            gain, vs = outcomes.get((n, baseline)), outcomes.get((n, s))
            missing = " and ".join(f"{a} vs {b}" for a, b in ((n, baseline), (n, s))
                                   if (a, b) not in family)
            if missing:
                head = f"described ({missing}: not a pre-registered comparison)"
            elif gain is None or vs is None:
                head = "described (pre-registered, but no verdict: see the positive control)"
            elif gain != "beats":
                head = f"no gain over {baseline} is shown here, so none to survive; described"
            else:
                head = {"beats": "yes", "worse": "no, it is worse", "none": "not shown",
                        "no verdict": "undetermined"}[vs]
            out.append({"nonlinear": n, "strong_baseline": s, "survives": head,
                        "paired": pair.to_dict(),
                        "answer": f"Does {n}'s gain survive against the QK-norm baseline {s}? "
                                  f"{head}: {describe(s, pair, outside=False)}."})
    return out


def stable_verdict(c: dict, unstable: set[str]) -> str:
    """prereg_verdict, or, for a comparison whose outcome changes with the summation order,
    a sentence that gives it as no finding."""
    name = f"{c['arm']} vs {c['against']}"
    if name not in unstable:
        return prereg_verdict(c)
    return (f"{name}: no finding: the verdict ({OUTCOME_WORDS[outcome(c)]} with the primary "
            f"runs) does not survive a change of summation order (see Numerical noise); "
            f"{numbers(c)}")
