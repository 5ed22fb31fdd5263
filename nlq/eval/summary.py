"""The content of report.json: statistics over seeds, and verdicts that claim only what the
intervals support.

Arms are compared to the baseline seed by seed (nlq.eval.stats.paired): the paper ran one
seed per arm (docs/paper.md, "The paper's numbers"), so every claim here is sized by the
paired 95% t-interval, and a single seed is reported as a single observation. An ordering
the experiment declares (nlq.eval.claims) is checked in the means and in paired intervals.
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
from nlq.eval.compare import compare, control_line, holm, passed
from nlq.eval.compare import verdict as prereg_verdict
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
               baseline: str) -> dict:
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
        row["verdict"] = verdict(name, baseline, pair)
    return row


def fmt_pct(x: float) -> str:
    return f"{abs(x):.2f}" if abs(x) >= 0.05 else f"{abs(x):.2g}"


def fmt_signed(x: float) -> str:
    return f"{x:+.2f}" if abs(x) >= 0.05 or x == 0 else f"{x:+.2g}"


def ci_text(e: Estimate) -> str:
    return f"{fmt_signed(e.lo)}..{fmt_signed(e.hi)}%"


def verdict(arm: str, base: str, pair: Paired) -> str:
    """One sentence on arm vs base that claims only what the paired interval supports."""
    return f"{arm}: {_verdict_body(base, pair)}"


def _verdict_body(base: str, pair: Paired) -> str:
    if pair.n == 0:
        return f"no seed in common with {base}, so no paired comparison"
    e = pair.log_loss()
    side = "below" if e.mean < 0 else "above"
    if pair.n == 1:
        return (f"1 seed: no interval, a single observation (log-loss "
                f"{fmt_pct(e.mean)}% {side} {base})")
    if e.excludes_zero:
        return (f"log-loss {fmt_pct(e.mean)}% {side} {base} (paired 95% CI "
                f"{ci_text(e)}, {pair.n} seeds)")
    return (f"not distinguishable from {base} at this scale with {pair.n} seeds "
            f"(mean {fmt_signed(e.mean)}%, paired 95% CI {ci_text(e)} spans 0)")


NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def ordering(rows: dict[str, dict], by_arm: dict[str, list[Run]], claims: Claims) -> dict | None:
    """The declared ordering (claims.ordering, lowest final log-loss first), checked in
    the means and by the paired interval between each two neighbours; None if none declared."""
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
    order_txt = " < ".join(f"{a} {means[a]:.4f}" for a in sorted(means, key=means.get))
    ranked = f"Mean final log-loss ranks them {order_txt}. "
    separated = False
    if any(e is None for e in ests.values()):
        status = "untested"
        ans = (f"{who} {chain} is not tested here: some arms share no seed, so there is no "
               f"paired interval between them. {ranked}")
    elif any(not e.has_interval for e in ests.values()):
        status = "untested"
        ans = (f"{who} {chain} is not tested here: with 1 seed there are no intervals. "
               f"{ranked}")
    else:
        # "holds" needs every neighbour pair separated in the claimed direction, "does not
        # hold" one pair separated the other way; a ranking of the means alone is neither
        parts = [f"{k} {fmt_signed(e.mean)}% (paired 95% CI {ci_text(e)})"
                 for k, e in ests.items()]
        separated = all(e.hi < 0 for e in ests.values())
        against = [k for k, e in ests.items() if e.lo > 0]
        n = NUMBER_WORDS.get(len(order), str(len(order)))
        if separated:
            status = "holds"
            ans = f"{who} {chain} holds here: the intervals separate the {n} arms. "
        elif against:
            status = "contradicted"
            ans = (f"{who} {chain} does not hold here: the interval of {' and '.join(against)} "
                   f"lies above 0. ")
        else:
            status = "unresolved"
            ans = (f"{who} {chain} is neither confirmed nor contradicted here: the intervals "
                   f"do not separate all {n} arms. ")
        ans += ranked + "Intervals: " + "; ".join(parts) + "."
    return {"testable": True, "arms": order, "means": means, "holds_in_means": holds,
            "separated_by_intervals": separated, "status": status,
            "paired": {k: p.to_dict() for k, p in pairs.items()}, "answer": ans}


def strong_baseline(rows: dict[str, dict], by_arm: dict[str, list[Run]],
                    baseline: str) -> list[dict]:
    """For each QK-norm linear arm: does each nonlinear arm's gain survive against it? Only a
    gain shown over the baseline (its paired interval below 0) can survive; without one the
    answer says so, and the comparison with the QK-norm arm is only described."""
    strong = [a for a, r in rows.items() if r["qk_norm"] and r["query"] == "linear"]
    nonlin = [a for a, r in rows.items() if r["query"] == "nonlinear"]
    out = []
    for s in strong:
        for n in nonlin:
            pair = paired(final(by_arm[n]), final(by_arm[s]))
            e = pair.log_loss()
            gain = (paired(final(by_arm[n]), final(by_arm[baseline])).log_loss()
                    if baseline in by_arm else None)
            if e is None or not e.has_interval:
                head = "undetermined"
            elif gain is None or not gain.has_interval or gain.hi >= 0:
                head = f"no gain over {baseline} is shown here, so none to survive; described"
            elif e.hi < 0:
                head = "yes"
            elif e.lo > 0:
                head = "no, it is worse"
            else:  # the interval spans 0: neither shown nor refuted
                head = "not shown"
            out.append({"nonlinear": n, "strong_baseline": s, "survives": head,
                        "paired": pair.to_dict(),
                        "answer": f"Does {n}'s gain survive against the QK-norm baseline {s}? "
                                  f"{head}: {_verdict_body(s, pair)}."})
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
    (its ordering is checked, its reference figures are carried along)."""
    claims = claims or Claims()
    done = [r for r in runs if r.finished]
    # reported numbers come from the test split; val only when some run has no test loss
    split = "test" if done and all(_finite(r.summary.get("test_loss")) for r in done) else "val"
    for r in done:
        r.loss_key = f"{split}_loss"
    if not done:
        where = ", ".join(str(r.dir) for r in runs[:3]) + (" ..." if len(runs) > 3 else "")
        raise NlqError(f"no finished run among {len(runs)} run(s) ({where}): every run lacks a "
                       f"finished summary.json")
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
        rows[a] = _arm_stats(a, by_arm[a], by_arm.get(baseline), base_row, baseline)
        if a == baseline:
            base_row = rows[a]
            for k in ("params_total", "params_non_embedding"):
                base_row[f"{k}_vs_baseline_pct"] = 0.0 if isinstance(base_row[k], int) else None

    notes = [f"{r.dir}: {n}" for r in done for n in r.notes]
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
    control, comps = None, []
    if claims.positive_control:
        control = compare(*claims.positive_control, by_arm, split == "test")
    for a, against in claims.comparisons:
        comps.append(compare(a, against, by_arm, split == "test"))
    holm(comps)
    allowed = control is None or passed(control)
    if not allowed:  # no verdict anywhere: the numbers stay, as descriptions
        for row in rows.values():
            if "verdict" in row:
                row["descriptive"] = row.pop("verdict")
    order = ordering(rows, by_arm, claims)
    if order is not None and not allowed:
        order = {"testable": False, "arms": order["arms"],
                 "answer": "The ordering is not checked: the positive control failed."}
    return {
        "title": title,
        "baseline": baseline if have_base else None,
        "level": LEVEL,
        "split": split,
        "first_line": control_line(control) if control is not None else None,
        "verdicts_allowed": allowed,
        "positive_control": control,
        "preregistered": comps,
        "preregistered_verdicts": [prereg_verdict(c) for c in comps] if allowed else [],
        "measured": {
            "metric": _metric_text(split, test),
            "val_sequences": b.train.eval_batches * b.train.micro_batch,
            "block_size": b.model.block_size,
            "model": {k: getattr(b.model, k) for k in ("arch", "n_layer", "n_head", "d_model",
                                                       "block_size", "vocab_size", "pos_emb")},
            "n_finished_runs": len(done),
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
        "strong_baseline": strong_baseline(rows, by_arm, baseline),
        "incomplete": [{"run_dir": str(r.dir), "arm": r.arm, "seed": r.seed,
                        "last_eval_step": r.last_step, "reason": r.problem}
                       for r in runs if not r.finished],
        "paper": claims.reference,
        "notes": notes,
    }


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
