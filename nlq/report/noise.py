"""Rounding noise: how much of what the report's intervals measure is the order in which the
runs summed their floats.

A run's final loss on CPU is a chaotic function of float rounding: the thread count and the
CPU's ISA path change the summation order, and training amplifies the difference. `nlq
reproduce --replicates K --replicate-threads M` trains seeds 0..K-1 of every arm again at M
threads (nlq/experiments/reproduce.py); each such replicate is set beside the primary run of
its arm and seed (nlq/report/runs.py), never counted as a seed. From them:

- per replicated run, replicate - primary in % of the primary's log-loss (the report's
  metric: test where every primary run has it, else val), with their RMS and sd;
- per pre-registered comparison and the positive control, the change of the per-seed paired
  difference when both arms' replicates replace their primaries, beside the seed-to-seed sd
  of the paired differences. With rounding noise of variance s^2 in each run's paired
  difference, independent between the two runs, the change has variance 2 s^2, so s^2 is
  estimated as mean(change^2) / 2 (the mean of the change is 0 by symmetry: primary and
  replicate are two summation orders, neither preferred). Its share of the seed-to-seed
  variance says how much of what the paired interval measures is rounding;
- each verdict and the control status recomputed with the replicated seeds' primaries
  swapped for their replicates (one swap per replicate thread count). A verdict that
  changes does not survive a change of summation order, and the report gives it as no
  finding (nlq/report/verdicts.py);
- where the primary runs come from more than one machine (CPU, ISA, thread count), the
  control and the pre-registered comparisons on each machine's runs alone (by_machine): a
  verdict that reverses on one machine's seeds would not survive a rerun elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from nlq.report.compare import outcome, passed
from nlq.report.runs import Run
from nlq.report.stats import rel_change_pct

LARGE_SHARE = 0.25
"""Rounding variance / seed-to-seed variance from which the report says rounding noise is a
large part of what its intervals measure."""

NOT_RECORDED = "not recorded"


def machine_rows(runs: list[Run]) -> list[dict]:
    """Each run's thread count, ISA and CPU as its summary.json records them (None: a run
    that predates the record)."""
    return [{"arm": r.arm, "seed": r.seed, "replicate": r.replicate, "run_dir": str(r.dir),
             "threads": r.machine("threads"), "isa": r.machine("isa"), "cpu": r.machine("cpu")}
            for r in runs]


def by_machine(by_arm: dict[str, list[Run]], control: dict | None, comps: list[dict],
               rejudge: Callable[[dict[str, list[Run]]], tuple[dict | None, list[dict]]]
               ) -> list[dict]:
    """Where the primary runs come from more than one machine (CPU, ISA, thread count): the
    positive control and the pre-registered comparisons on each machine's runs alone (a pair
    keeps the seeds both its arms ran there; Holm within the group), and, per comparison,
    whether the whole's outcome holds there. A rerun elsewhere is one more draw of rounding
    noise; a verdict that reverses on one machine's seeds would not survive it. A group has
    fewer seeds than the whole, so a verdict may fall to no difference there by power alone:
    the report says which, a description beside the verdicts, not a test of its own."""
    def key(r: Run) -> tuple[str, str, str]:
        return (r.machine("cpu") or NOT_RECORDED, r.machine("isa") or NOT_RECORDED,
                str(r.machine("threads") or NOT_RECORDED))

    groups = sorted({key(r) for rs in by_arm.values() for r in rs})
    if len(groups) < 2:
        return []
    whole = {(c["arm"], c["against"]): c for c in comps}
    out = []
    for g in groups:
        sub = {a: [r for r in rs if key(r) == g] for a, rs in by_arm.items()}
        gc, gcomps = rejudge({a: rs for a, rs in sub.items() if rs})
        rows = []
        for role, c, w in ([("positive control", gc, control)] if control else []) + [
                ("pre-registered", c, whole.get((c["arm"], c["against"]))) for c in gcomps]:
            row = {"arm": c["arm"], "against": c["against"], "role": role,
                   "n_seeds": c["n_seeds"]}
            if "problem" in c:
                row["outcome"] = "no verdict"
            else:
                row |= {"mean_pct": c["mean_pct"], "ci95": c["ci95"]}
                if role == "positive control":
                    row["outcome"] = "passes" if passed(c) else "fails"
                else:
                    row |= {"p_holm": c["p_holm"], "outcome": outcome(c)}
            if w is not None and "problem" not in w and "problem" not in c:
                base = ("passes" if passed(w) else "fails") if role == "positive control" \
                    else outcome(w)
                row["whole"] = base
                row["reversed"] = {base, row["outcome"]} == {"beats", "worse"}
            rows.append(row)
        out.append({"cpu": g[0], "isa": g[1], "threads": g[2],
                    "n_runs": sum(len(v) for v in sub.values()), "comparisons": rows})
    return out


def spread(xs: list[float]) -> dict:
    """n, mean, RMS (around 0: the size of the noise, defined from one value) and sd (from 2)."""
    n = len(xs)
    if not n:
        return {"n": 0, "mean": None, "rms": None, "sd": None}
    mean = math.fsum(xs) / n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else None
    return {"n": n, "mean": mean, "rms": math.sqrt(math.fsum(x * x for x in xs) / n), "sd": sd}


def numerical_noise(by_arm: dict[str, list[Run]], replicates: list[Run], control: dict | None,
                    comps: list[dict],
                    rejudge: Callable[[dict[str, list[Run]]], tuple[dict | None, list[dict]]]
                    ) -> dict:
    """The rounding-noise section of report.json. by_arm: the primary runs, each with its
    loss_key set; replicates: finished replicate runs; control, comps: the positive control
    and the pre-registered comparisons of the primaries; rejudge(by_arm) computes them again
    (nlq.report.compare.judge) for the swapped runs."""
    primaries = [r for rs in by_arm.values() for r in rs]
    prim = {(r.arm, r.seed): r for r in primaries}
    out = {"runs": machine_rows(primaries + replicates),
           "machines": sorted({r.machine("cpu") or NOT_RECORDED
                               for r in primaries + replicates}),
           "isas": sorted({r.machine("isa") or NOT_RECORDED for r in primaries + replicates}),
           "skipped": []}
    used: dict[tuple, Run] = {}  # (arm, seed, tag) -> replicate
    for r in replicates:
        p = prim.get((r.arm, r.seed))
        if p is None:
            out["skipped"].append(f"{r.dir}: no finished primary run of {r.arm} seed {r.seed}")
        elif not _finite(r.summary.get(p.loss_key)):
            out["skipped"].append(f"{r.dir}: no {p.loss_key} in summary.json")
        else:
            r.loss_key = p.loss_key
            used[r.run_key] = r
    out["by_machine"] = by_machine(by_arm, control, comps, rejudge)
    out["measured"] = bool(used)
    if not used:
        return out
    # seed by seed, arms in the report's order: as `nlq reproduce` plans them, whatever order
    # the run dirs came in (`nlq report` finds them folder by folder, arm by arm)
    pos = {a: i for i, a in enumerate(by_arm)}
    used = dict(sorted(used.items(), key=lambda kv: (str(kv[0][1]).zfill(12),
                                                     pos.get(kv[0][0], len(pos)), str(kv[0][2]))))
    out["replicates"] = [
        {"arm": r.arm, "seed": r.seed, "run_dir": str(r.dir), "threads": tag,
         "primary_threads": prim[(a, s)].machine("threads"), "primary_loss": prim[(a, s)].final_loss,
         "replicate_loss": r.final_loss,
         "diff_pct": rel_change_pct(r.final_loss, prim[(a, s)].final_loss)}
        for (a, s, tag), r in used.items()]
    out["run_diff_pct"] = spread([x["diff_pct"] for x in out["replicates"]])
    out["identical"] = sum(x["primary_loss"] == x["replicate_loss"] for x in out["replicates"])
    roles = ([("positive control", control)] if control else []) + [
        ("pre-registered", c) for c in comps]
    out["comparisons"] = [_paired_change(role, c, prim, used) for role, c in roles]
    shares = [c for c in out["comparisons"] if c["share"] is not None]
    out["largest_share"] = max((c["share"] for c in shares), default=None)
    out["large"] = out["largest_share"] is not None and out["largest_share"] >= LARGE_SHARE
    out["swapped"] = [_swapped(tag, by_arm, used, control, comps, rejudge)
                      for tag in sorted({k[2] for k in used}, key=str)]
    out["unstable"] = sorted({name for s in out["swapped"] for name in s["changed"]})
    out["control_unstable"] = any(s["control_changed"] for s in out["swapped"])
    return out


def _paired_change(role: str, c: dict, prim: dict, used: dict) -> dict:
    """How the per-seed paired difference of comparison c moves when both arms' replicates
    (at one thread count) replace their primaries."""
    a, b = c["arm"], c["against"]
    rows = []
    for (arm, seed, tag), ra in used.items():
        rb = used.get((b, seed, tag))
        if arm != a or rb is None or seed not in c.get("seeds", []):
            continue
        before = rel_change_pct(prim[(a, seed)].final_loss, prim[(b, seed)].final_loss)
        after = rel_change_pct(ra.final_loss, rb.final_loss)
        rows.append({"seed": seed, "threads": tag, "primary_pct": before,
                     "replicate_pct": after, "change_pct": after - before})
    ch = spread([x["change_pct"] for x in rows])
    seed_sd = c.get("sd_pct")
    share = ch["rms"] ** 2 / 2 / seed_sd ** 2 if ch["n"] and seed_sd else None
    return {"arm": a, "against": b, "role": role, "per_seed": rows, "change_pct": ch,
            "seed_sd_pct": seed_sd, "share": share}


def _swapped(tag, by_arm: dict[str, list[Run]], used: dict, control: dict | None,
             comps: list[dict], rejudge) -> dict:
    """The control and the verdicts again, each primary with a replicate at `tag` swapped
    for it."""
    swapped = {arm: [used.get((arm, r.seed, tag), r) for r in rs] for arm, rs in by_arm.items()}
    ctrl2, comps2 = rejudge(swapped)
    seeds = sorted({k[1] for k in used if k[2] == tag}, key=str)
    rows = [{"arm": c["arm"], "against": c["against"], "primary": outcome(c),
             "swapped": outcome(c2), "swapped_comparison": _brief(c2)}
            for c, c2 in zip(comps, comps2)]
    out = {"threads": tag, "seeds": seeds, "comparisons": rows,
           "changed": [f"{x['arm']} vs {x['against']}" for x in rows
                       if x["primary"] != x["swapped"]],
           "control_changed": False}
    if control is not None:
        out["control"] = {"arm": control["arm"], "against": control["against"],
                          "primary": passed(control), "swapped": passed(ctrl2),
                          "swapped_comparison": _brief(ctrl2)}
        out["control_changed"] = passed(control) != passed(ctrl2)
    return out


def _brief(c: dict) -> dict:
    keep = ("mean_pct", "ci95", "ci_holm", "p_holm", "problem")
    return {k: c[k] for k in keep if k in c} | (
        {"bootstrap": c["bootstrap"]} if "bootstrap" in c else {})


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


OUTCOME_WORDS = {"beats": "beats", "worse": "is worse", "none": "no detectable difference",
                 "no verdict": "no verdict"}


def rounding_line(noise: dict, verdicts_given: bool) -> str | None:
    """The report's first line when the control status, or a verdict the report would give
    (verdicts_given: the control passed with the primary runs, or there is none), changes
    with the summation order; None when none does (or nothing was measured)."""
    if not noise.get("measured"):
        return None
    parts = []
    for s in noise["swapped"]:
        where = (f"seed(s) {', '.join(map(str, s['seeds']))} replaced by their replicates at "
                 f"{s['threads']} threads")
        c = s.get("control")
        if s["control_changed"]:
            parts.append(f"the positive control ({c['arm']} vs {c['against']}) "
                         f"{'passes' if c['primary'] else 'fails'} with the primary runs and "
                         f"{'passes' if c['swapped'] else 'fails'} with {where}")
        parts += [f"{x['arm']} vs {x['against']}: {OUTCOME_WORDS[x['primary']]} with the "
                  f"primary runs, {OUTCOME_WORDS[x['swapped']]} with {where}"
                  for x in s["comparisons"] if verdicts_given and x["primary"] != x["swapped"]]
    if not parts:
        return None
    if noise["control_unstable"]:
        return (f"The positive control does not survive a change of summation order, so no "
                f"verdict is given: {'; '.join(parts)}.")
    tail = "It is not given as a finding." if len(parts) == 1 else \
        "They are not given as findings."
    return (f"The verdict does not survive a change of summation order: {'; '.join(parts)}. "
            f"{tail}")


def share_text(share: float) -> str:
    """A variance ratio in words: "12% of", or "3.4 times" where rounding exceeds the seeds."""
    return f"{100 * share:.2g}% of" if share < 1 else f"{share:.2g} times"


def share_sentence(noise: dict) -> str | None:
    """Whether rounding noise is a large part of what the paired intervals measure."""
    shares = [c for c in noise.get("comparisons", []) if c["share"] is not None]
    if not shares:
        return None
    top = max(shares, key=lambda c: c["share"])
    n = top["change_pct"]["n"]
    few = f" (from {n} replicated seed(s): a rough estimate)" if n < 5 else ""
    nums = (f"for {top['arm']} vs {top['against']} the paired difference moves by "
            f"{top['change_pct']['rms']:.3g}% (RMS) under a change of summation order, against "
            f"a seed-to-seed sd of {top['seed_sd_pct']:.3g}%: rounding variance "
            f"(RMS^2 / 2) is {share_text(top['share'])} the seed-to-seed variance{few}")
    if top["share"] >= LARGE_SHARE:
        return (f"Rounding noise is a large part of what the intervals measure: {nums}. The "
                f"seeds' spread is then partly the spread of summation orders, and a verdict "
                f"near the edge of its interval can move with the thread count or the CPU.")
    return f"Rounding noise is a small part of the seed-to-seed spread here: {nums}."
