"""The content of report.json: statistics over seeds, and verdicts that claim only what the
intervals support.

Arms are compared to the baseline seed by seed (nlq.report.stats.paired): the paper ran one
seed per arm (docs/paper.md, "The paper's numbers"), so every number here is sized by the
paired 95% t-interval, and a single seed is reported as a single observation.

Verdicts come only from the Holm family: the experiment's pre-registered comparisons
(nlq.report.claims, nlq.report.compare), once the positive control has passed. Every other
statement about two arms is derived from their outcomes or only described: each arm against
the baseline is described; the declared ordering holds or fails only where each neighbouring
pair is a pre-registered comparison or the positive control; a nonlinear gain "survives" a
QK-norm baseline only where both pairs are pre-registered. Seeds are primary runs only;
numerical replicates (nlq.report.runs) measure rounding noise (nlq.report.noise), and a verdict
that changes when they replace their primaries is no finding. Convergence: nlq.report.convergence.

Here the report is put together: the seeds, the split, the notes, the data dirs; each arm's
row comes from nlq.report.arm_rows, the verdicts read from the Holm family from
nlq.report.verdicts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from nlq.errors import NlqError
from nlq.report.arm_rows import arm_rows
from nlq.report.claims import Claims
from nlq.report.compare import control_line, judge, outcome, passed
from nlq.report.convergence import convergence, convergence_text
from nlq.report.noise import numerical_noise, rounding_line, share_sentence
from nlq.report.references import references
from nlq.report.runs import Run, final, read_json
from nlq.report.stats import LEVEL, high_outliers
from nlq.report.verdicts import (
    NUMBER_WORDS,
    ci_text,
    describe,
    fmt_pct,
    fmt_signed,
    ordering,
    stable_verdict,
    strong_baseline,
)

# the verdicts (verdicts.py) and the seeds' final losses (runs.py) live beside summarize;
# their names stay importable from here
__all__ = ["NUMBER_WORDS", "ci_text", "describe", "final", "fmt_pct", "fmt_signed", "ordering",
           "strong_baseline", "summarize"]


def _data_info(runs: list[Run], split: str) -> dict:
    """meta.json of each data dir, and the unigram and bigram references on the report's
    split (nlq/report/references.py)."""
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
    rows = arm_rows(by_arm, baseline,
                    {*claims.comparisons, *filter(None, [claims.positive_control])})

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
    # the val set is eval_batches x micro_batch windows of block_size: runs that differ there
    # report val losses over different sequences (their test split is the same)
    val_sets = {(r.cfg.train.eval_batches * r.cfg.train.micro_batch, r.cfg.model.block_size)
                for r in done}
    if len(val_sets) > 1:
        notes.append("runs were scored on different val sets (eval_batches x micro_batch "
                     "windows of block_size tokens: " + ", ".join(
                         f"{n} x {t}" for n, t in sorted(val_sets)) + "): their val losses "
                     "are not over the same sequences")
    data = _data_info(done, split)
    if len(data["dirs"]) > 1:
        notes.append(f"runs used different data dirs: {', '.join(data['dirs'])}")
    b = by_arm[baseline][0].cfg if have_base else done[0].cfg
    test = done[0].summary if split == "test" else {}

    def rejudge(arms: dict[str, list[Run]]) -> tuple[dict | None, list[dict]]:
        return judge(claims.positive_control, claims.comparisons, arms, split == "test")

    control, comps = rejudge(by_arm)
    for c in ([control] if control else []) + comps:
        for a, seeds in (c.get("unpaired") or {}).items():
            if seeds:
                notes.append(f"{c['arm']} vs {c['against']}: seed(s) {seeds} of {a} have no "
                             f"finished partner in the other arm and are not in this comparison")
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
        "preregistered_verdicts": [stable_verdict(c, unstable) for c in comps]
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
        "outliers": outliers(by_arm),
        "ordering": order,
        "strong_baseline": strong_baseline(
            rows, by_arm, baseline, outcomes,
            {(c["arm"], c["against"]) for c in comps}
            | ({tuple(claims.positive_control)} if control is not None else set())),
        "numerical_noise": noise,
        "convergence": conv,
        "attention_logits": logit_ranges({a: by_arm[a] for a in rows}),
        "incomplete": [{"run_dir": str(r.dir), "arm": r.arm, "seed": r.seed,
                        "replicate": r.replicate, "last_eval_step": r.last_step,
                        "reason": r.problem}
                       for r in runs if not r.finished],
        "paper": claims.reference,
        "notes": notes,
    }



def logit_ranges(by_arm: dict[str, list]) -> list[dict]:
    """Per arm, over its seeds that recorded it (summary.json "attn_logits", nlq/run/scoring.py):
    the mean of each run's largest |attention logit| over its layers, the largest over runs,
    and the mean logit sd over layers and runs. Empty when no run recorded it."""
    out = []
    for arm, runs in by_arm.items():
        recs = [r.summary["attn_logits"] for r in runs if (r.summary or {}).get("attn_logits")]
        if not recs:
            continue
        tops = [max(x["max_abs"]) for x in recs]
        sds = [v for x in recs for v in x["sd"]]
        out.append({"arm": arm, "n_seeds": len(recs), "max_abs_mean": math.fsum(tops) / len(tops),
                    "max_abs_max": max(tops), "sd_mean": math.fsum(sds) / len(sds),
                    "rows": recs[0].get("rows")})
    return out


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


def outliers(by_arm: dict[str, list[Run]]) -> list[dict]:
    """The runs whose final loss lies more than OUTLIER_Z robust sds above their arm's median
    (stats.high_outliers): flagged for the reader, kept in every statistic."""
    import statistics

    out = []
    for arm, runs in by_arm.items():
        losses = final(runs)
        med = statistics.median(losses.values()) if losses else None
        for seed, z in high_outliers(losses).items():
            out.append({"arm": arm, "seed": seed, "loss": losses[seed], "median": med,
                        "robust_z": z})
    return out
