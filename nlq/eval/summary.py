"""The content of report.json: statistics over seeds, and verdicts that claim only what the
intervals support.

Arms are compared to the baseline seed by seed (nlq.eval.stats.paired): the paper ran one
seed per arm (docs/paper.md, "The paper's numbers"), so every number here is sized by the
paired 95% t-interval, and a single seed is reported as a single observation.

Verdicts come only from the Holm family: the experiment's pre-registered comparisons
(nlq.eval.claims, nlq.eval.compare), once the positive control has passed. Every other
statement about two arms is derived from their outcomes or only described: each arm against
the baseline is described; the declared ordering holds or fails only where each neighbouring
pair is a pre-registered comparison or the positive control; a nonlinear gain "survives" a
QK-norm baseline only where both pairs are pre-registered. Seeds are primary runs only;
numerical replicates (nlq.eval.runs) measure rounding noise (nlq.eval.noise), and a verdict
that changes when they replace their primaries is no finding. Convergence: nlq.eval.convergence.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from nlq.config import flatten
from nlq.errors import NlqError
from nlq.eval.claims import Claims
from nlq.eval.compare import control_line, judge, numbers, outcome, passed
from nlq.eval.compare import verdict as prereg_verdict
from nlq.eval.convergence import convergence, convergence_text
from nlq.eval.noise import OUTCOME_WORDS, numerical_noise, rounding_line, share_sentence
from nlq.eval.references import references
from nlq.eval.runs import Run, read_json
from nlq.eval.stats import LEVEL, Estimate, Paired, mean_ci, paired


def _arm_order(arms: Sequence[str], baseline: str) -> list[str]:
    return sorted(set(arms), key=lambda a: (a != baseline, a))


def final(runs: list[Run]) -> dict:
    return {r.seed: r.final_loss for r in runs}


def _config_diffs(runs: list[Run]) -> list[str]:
    """Config keys (other than the seeds and the device) that differ between an arm's runs."""
    ignore = {"train.seed", "data.seed", "train.device"}
    flat = [flatten(r.cfg.to_dict()) for r in runs]
    return sorted(k for k in flat[0] if k not in ignore and len({repr(f.get(k)) for f in flat}) > 1)


def _pct_vs(n: int | None, base: int | None) -> float | None:
    if n is None or not base:
        return None
    return 100.0 * (n - base) / base


def _arm_stats(name: str, runs: list[Run], base_runs: list[Run] | None, base_row: dict | None,
               baseline: str, family: set) -> dict:
    """An arm's row; family: the (arm, against) pairs that get verdicts (the pre-registered
    comparisons and the positive control), whose row against the baseline is described
    without the note that it is outside them."""
    cfg = runs[0].cfg
    losses = [r.final_loss for r in runs]  # test where every run has it, else val
    vals = [float(r.summary["val_loss"]) for r in runs]
    ppls = [math.exp(x) for x in losses]
    params_total = sorted({r.summary.get("params_total") for r in runs}, key=str)
    params_ne = sorted({r.summary.get("params_non_embedding") for r in runs}, key=str)
    tokens = sorted({r.tokens for r in runs}, key=str)
    steps = sorted({r.summary.get("step") for r in runs}, key=str)
    row = {
        "arm": name,
        "label": next((r.label for r in runs if r.label), None),
        "experiments": sorted({r.experiment for r in runs if r.experiment}),
        "query": cfg.model.query,
        "qk_norm": cfg.model.qk_norm,
        "mlp_width": cfg.model.mlp_width,
        "lr": cfg.train.lr,
        "weight_decay": cfg.train.weight_decay,
        "params_total": params_total[0] if len(params_total) == 1 else params_total,
        "params_non_embedding": params_ne[0] if len(params_ne) == 1 else params_ne,
        "n_seeds": len(runs),
        "seeds": [r.seed for r in runs],
        "train_seeds": sorted({r.cfg.train.seed for r in runs}),
        "data_seeds": sorted({r.cfg.data.seed for r in runs}),
        "steps": steps[0] if len(steps) == 1 else steps,
        "tokens_per_step": runs[0].tokens_per_step,
        "tokens_per_run": tokens[0] if len(tokens) == 1 else tokens,
        "loss": mean_ci(losses).to_dict(),
        "ppl_mean": sum(ppls) / len(ppls),
        "val_loss": mean_ci(vals).to_dict(),
        "val_ppl_mean": sum(math.exp(x) for x in vals) / len(vals),
        "n_spikes": [int(r.summary.get("n_spikes", 0)) for r in runs],
        "per_seed": [{"seed": r.seed, "run_dir": str(r.dir), "loss": r.final_loss,
                      "val_loss": float(r.summary["val_loss"]),
                      "ppl": math.exp(r.final_loss), "tokens": r.tokens,
                      "spikes": r.summary.get("spikes", [])} for r in runs],
        "config_differs_in": _config_diffs(runs),
    }
    if base_row is not None:
        for k in ("params_total", "params_non_embedding"):
            v, b = row[k], base_row[k]
            ok = isinstance(v, int) and isinstance(b, int)
            row[f"{k}_vs_baseline_pct"] = _pct_vs(v, b) if ok else None
    if base_runs is not None and name != baseline:
        pair = paired(final(runs), final(base_runs))
        row["vs_baseline"] = pair.to_dict()
        row["preregistered"] = (name, baseline) in family
        row["descriptive"] = f"{name}: {describe(baseline, pair, not row['preregistered'])}"
    return row


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
                    outcomes: dict[tuple[str, str], str]) -> list[dict]:
    """For each QK-norm linear arm: does each nonlinear arm's gain survive against it? A
    verdict only where both (nonlinear, baseline) and (nonlinear, QK-norm arm) are in the
    Holm family (outcomes), and only a gain shown over the baseline ("beats") can survive;
    otherwise the pair is described."""
    strong = [a for a, r in rows.items() if r["qk_norm"] and r["query"] == "linear"]
    nonlin = [a for a, r in rows.items() if r["query"] == "nonlinear"]
    out = []
    for s in strong:
        for n in nonlin:
            pair = paired(final(by_arm[n]), final(by_arm[s]))
            gain, vs = outcomes.get((n, baseline)), outcomes.get((n, s))
            if gain is None or vs is None:
                missing = " and ".join(f"{a} vs {b}" for a, b in ((n, baseline), (n, s))
                                       if (a, b) not in outcomes)
                head = f"described ({missing}: not a pre-registered comparison)"
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


def _data_info(runs: list[Run], split: str) -> dict:
    """meta.json of each data dir, and the unigram and bigram references on the report's
    split (nlq/eval/references.py)."""
    from nlq.data.schedule import TokenData

    dirs = sorted({r.cfg.data.dir for r in runs})
    info = {"dirs": dirs, "meta": {}, "references": {}}
    for d in dirs:
        meta = read_json(Path(d) / "meta.json")
        info["meta"][d] = meta if isinstance(meta, dict) else None
        try:
            data = TokenData.open(d)
        except NlqError:
            info["references"][d] = None
            continue
        info["references"][d] = references(data, split if data.test is not None else "val")
    return info


def summarize(runs: list[Run], baseline: str = "linear", title: str = "nlq report",
              claims: Claims | None = None) -> dict:
    """The content of report.json, from collected runs; claims: what the experiment declares
    (its Holm family and control, its ordering; its reference figures are carried along)."""
    claims = claims or Claims()
    done = [r for r in runs if r.finished and not r.replicate]  # the seeds
    replicates = [r for r in runs if r.finished and r.replicate]
    # reported numbers come from the test split; val only when some run has no test loss
    split = "test" if done and all(_finite(r.summary.get("test_loss")) for r in done) else "val"
    for r in done:
        r.loss_key = f"{split}_loss"
    if not done:
        where = ", ".join(str(r.dir) for r in runs[:3]) + (" ..." if len(runs) > 3 else "")
        raise NlqError(f"no finished run among {len(runs)} run(s) ({where}): every run lacks a "
                       f"finished summary.json" + (" (only replicates are finished)"
                                                   if replicates else ""))
    by_arm: dict[str, list[Run]] = {}
    for r in done:
        by_arm.setdefault(r.arm, []).append(r)
    for rs in by_arm.values():
        rs.sort(key=lambda r: (isinstance(r.seed, str), r.seed))
    if baseline not in by_arm and len(by_arm) > 1:
        inc = [r for r in runs if r.arm == baseline]
        why = f" ({len(inc)} run(s) of it are incomplete)" if inc else ""
        raise NlqError(f"baseline arm {baseline!r} has no finished run{why}; arms: "
                       f"{', '.join(sorted(by_arm))} (choose one with --baseline ARM)")
    have_base = baseline in by_arm
    rows: dict[str, dict] = {}
    base_row = None
    for a in _arm_order(list(by_arm), baseline):
        rows[a] = _arm_stats(a, by_arm[a], by_arm.get(baseline), base_row, baseline,
                             {*claims.comparisons, *filter(None, [claims.positive_control])})
        if a == baseline:
            base_row = rows[a]
            for k in ("params_total", "params_non_embedding"):
                base_row[f"{k}_vs_baseline_pct"] = 0.0 if isinstance(base_row[k], int) else None

    notes = [f"{r.dir}: {n}" for r in done + replicates for n in r.notes]
    for a, row in rows.items():
        vs = row.get("vs_baseline") or {}
        if vs.get("seeds_only_in_arm"):
            notes.append(f"arm {a}: seed(s) {vs['seeds_only_in_arm']} have no {baseline} run "
                         f"with the same seed and are not in its paired comparison")
        if row["config_differs_in"]:
            notes.append(f"arm {a}: its runs differ in {', '.join(row['config_differs_in'])}")
    token_sets = {json.dumps(r["tokens_per_run"]) for r in rows.values()}
    if len(token_sets) > 1:
        notes.append("arms were trained for different numbers of tokens")
    data = _data_info(done, split)
    if len(data["dirs"]) > 1:
        notes.append(f"runs used different data dirs: {', '.join(data['dirs'])}")
    b = by_arm[baseline][0].cfg if have_base else done[0].cfg
    test = done[0].summary if split == "test" else {}

    def rejudge(arms: dict[str, list[Run]]) -> tuple[dict | None, list[dict]]:
        return judge(claims.positive_control, claims.comparisons, arms, split == "test")

    control, comps = rejudge(by_arm)
    noise = numerical_noise(by_arm, replicates, control, comps, rejudge)
    notes += noise["skipped"]
    allowed = (control is None or passed(control)) and not noise.get("control_unstable")
    unstable = set(noise.get("unstable", [])) if allowed else set()
    # the Holm family's outcomes, which the ordering and the QK-norm question are read from;
    # a verdict that changes with the summation order counts as no difference
    outcomes = {}
    if allowed:
        outcomes = {(c["arm"], c["against"]): "none" if f"{c['arm']} vs {c['against']}"
                    in unstable else outcome(c) for c in comps}
        if control is not None:
            outcomes[tuple(claims.positive_control)] = "beats"  # it passed
    order = ordering(rows, by_arm, claims, outcomes)
    if order is not None and not allowed:
        order = {"testable": False, "arms": order["arms"],
                 "answer": "The ordering is not checked: the positive control "
                           + ("does not survive a change of summation order."
                              if noise.get("control_unstable") else "failed.")}
    judged = [c for c in ([control] if control else []) + comps if "half_width_95_pct" in c]
    if judged:
        narrow = min(judged, key=lambda c: c["half_width_95_pct"])
        hw, by = narrow["half_width_95_pct"], f"{narrow['arm']} vs {narrow['against']}"
    else:  # no pre-registered interval: the paired intervals against the baseline
        vs = [(r["vs_baseline"]["log_loss_pct"], r["arm"]) for r in rows.values()
              if (r.get("vs_baseline") or {}).get("log_loss_pct") and
              r["vs_baseline"]["log_loss_pct"]["lo"] is not None]
        e, arm = min(vs, key=lambda x: x[0]["hi"] - x[0]["lo"]) if vs else (None, None)
        hw, by = ((e["hi"] - e["lo"]) / 2, f"{arm} vs {baseline}") if e else (None, None)
    conv = convergence({a: by_arm[a] for a in rows}, hw, by)
    conv["answer"] = convergence_text(conv)
    noise["share_answer"] = share_sentence(noise)
    return {
        "title": title,
        "baseline": baseline if have_base else None,
        "level": LEVEL,
        "split": split,
        "rounding_line": rounding_line(noise, control is None or passed(control)),
        "first_line": control_line(control) if control is not None else None,
        "verdicts_allowed": allowed,
        "positive_control": control,
        "preregistered": comps,
        "preregistered_verdicts": [_stable_verdict(c, unstable) for c in comps]
        if allowed else [],
        "measured": {
            "metric": _metric_text(split, test),
            "val_sequences": b.train.eval_batches * b.train.micro_batch,
            "block_size": b.model.block_size,
            "model": {k: getattr(b.model, k) for k in ("arch", "n_layer", "n_head", "d_model",
                                                       "block_size", "vocab_size", "pos_emb")},
            "n_finished_runs": len(done),
            "n_replicates": len(replicates),
            "n_arms": len(rows),
        },
        "data": data,
        "arms": list(rows.values()),
        "stability": [{"arm": r.arm, "seed": r.seed, "run_dir": str(r.dir),
                       "n_spikes": int(r.summary.get("n_spikes", 0)),
                       "warmup_steps": r.summary.get("warmup_steps"),
                       "spikes": r.summary.get("spikes", [])}
                      for r in done if r.summary.get("n_spikes")],
        "ordering": order,
        "strong_baseline": strong_baseline(rows, by_arm, baseline, outcomes),
        "numerical_noise": noise,
        "convergence": conv,
        "incomplete": [{"run_dir": str(r.dir), "arm": r.arm, "seed": r.seed,
                        "replicate": r.replicate, "last_eval_step": r.last_step,
                        "reason": r.problem}
                       for r in runs if not r.finished],
        "paper": claims.reference,
        "notes": notes,
    }


def _stable_verdict(c: dict, unstable: set[str]) -> str:
    """prereg_verdict, or, for a comparison whose outcome changes with the summation order,
    a sentence that gives it as no finding."""
    name = f"{c['arm']} vs {c['against']}"
    if name not in unstable:
        return prereg_verdict(c)
    return (f"{name}: no finding: the verdict ({OUTCOME_WORDS[outcome(c)]} with the primary "
            f"runs) does not survive a change of summation order (see Numerical noise); "
            f"{numbers(c)}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _metric_text(split: str, test: dict) -> str:
    if split == "test":
        return (f"log-loss (mean cross-entropy, nats per token) of each run at its last step, "
                f"on the whole test split ({test.get('test_docs')} documents, "
                f"{test.get('test_tokens'):,} tokens)")
    return ("final validation log-loss (mean cross-entropy, nats per token) of each run at its "
            "last step: these runs have no test split, so the reported numbers come from the "
            "split any tuning looked at")
