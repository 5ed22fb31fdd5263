"""report.md from report.json's content (nlq.report.summary.summarize): one function per
section, in the order they appear; the sections on numerical noise and convergence are
rendered by nlq.report.markdown_noise, as is the attention logits' range. Its first lines say what stops a verdict: a verdict or a
control status that changes with the summation order (nlq.report.noise), then the positive
control."""

from __future__ import annotations

import json

from nlq.report.markdown_noise import convergence_section, logits_section, noise_section
from nlq.report.stats import OUTLIER_Z
from nlq.report.verdicts import fmt_signed


def render_markdown(rep: dict, fig_name: str | None = "fig1.png") -> str:
    L = [f"# {rep['title']}", ""]
    if rep.get("rounding_line"):
        L += [f"**{rep['rounding_line']}**", ""]
    if rep.get("first_line"):
        L += [f"**{rep['first_line']}**", ""]
    L += _measured(rep) + _results(rep) + _preregistered(rep) + _verdicts(rep)
    L += noise_section(rep) + convergence_section(rep) + logits_section(rep) + _stability(rep)
    if fig_name:
        L += ["## Fig. 1", "", f"![Fig. 1]({fig_name})", "",
              ("Top: validation log-loss against optimizer steps, mean over seeds (band: "
               "min..max over seeds). Bottom: improvement over the baseline, "
               "100·(L_base − L_arm)/L_base per seed paired by seed, mean over seeds (band: "
               "min..max); positive = lower loss than the baseline. Finished runs only."), ""]
    if rep["paper"]:
        L += _reference(rep["paper"])
    if rep["incomplete"]:
        L += ["## Incomplete runs (excluded from the statistics)", "",
              "Unfinished runs, and finished runs without a finite final val loss.", ""]
        for r in rep["incomplete"]:
            L.append(f"- `{r['run_dir']}` (arm {r['arm']}, seed {r['seed']}): {r['reason']}")
        L.append("")
    if rep["notes"]:
        L += ["## Notes", ""] + [f"- {n}" for n in rep["notes"]] + [""]
    L += [("Intervals: two-sided 95% Student-t intervals over seeds (mean ± t·sd/√n, n−1 "
           "degrees of freedom); with 1 seed none is given. Paired intervals use the per-seed "
           "differences of runs with the same seed."), ""]
    return "\n".join(L)


def _measured(rep: dict) -> list[str]:
    base = rep["baseline"]
    m = rep["measured"]
    mod = m["model"]
    L = ["## What was measured", ""]
    L.append(f"- Metric: {m['metric']}; perplexity = exp(log-loss). Final val log-loss (on "
             f"{m['val_sequences']} fixed validation sequences of {m['block_size']} tokens) is "
             f"shown beside it: val chose the lrs, so it is not the reported number.")
    L.append(f"- Model ({'baseline' if base else 'first run'} config): {mod['arch']}, "
             f"{mod['n_layer']} layers, d_model {mod['d_model']}, {mod['n_head']} heads, "
             f"context {mod['block_size']}, vocab {mod['vocab_size']}, {mod['pos_emb']} "
             f"positions.")
    for d in rep["data"]["dirs"]:
        meta = rep["data"]["meta"].get(d)
        if meta:
            keys = ("tokenizer", "vocab_size", "train_tokens", "val_tokens", "source", "corpus")
            desc = ", ".join(f"{k} {_int(meta[k]) if isinstance(meta[k], int) else meta[k]}"
                             for k in keys if k in meta)
            L.append(f"- Data: `{d}` ({desc or 'meta.json has none of the usual keys'}).")
            ref = rep["data"].get("references", {}).get(d)
            if ref is not None:
                L.append(f"- References on the {ref['split']} split: a unigram model (token "
                         f"frequencies of the train split) scores {ref['unigram']:.4f}, a "
                         f"count-based bigram model (add-k, k = {ref['bigram_k']:g} chosen on "
                         f"val) {ref['bigram']:.4f}: a run above the bigram has not learned "
                         f"more than pairs of tokens.")
        else:
            L.append(f"- Data: `{d}` (its meta.json is not readable from here).")
    L.append(f"- Runs: {m['n_finished_runs']} finished, over {m['n_arms']} arm(s); seeds per "
             f"arm: " + ", ".join(f"{r['arm']} {r['n_seeds']}" for r in rep["arms"]) + ".")
    tok = {json.dumps(r["tokens_per_run"]): r for r in rep["arms"]}
    for r in tok.values():
        L.append(f"- Tokens per run: {_int(r['tokens_per_run'])} ({_int(r['steps'])} steps x "
                 f"{_int(r['tokens_per_step'])} tokens per step)"
                 + ("" if len(tok) == 1 else f" for arm {r['arm']} and those with the same") + ".")
    if rep.get("lrs"):
        lr = rep["lrs"]
        L.append(f"- Learning rates: chosen per arm on val by `nlq sweep` ({lr['source']}, "
                 f"commit {(lr.get('commit') or 'unknown')[:10]}"
                 f"{', dirty' if lr.get('dirty') else ''}): "
                 + ", ".join(f"{a} {v:.3g}" for a, v in lr["lrs"].items()) + ".")
        if lr.get("edge"):
            L.append(f"- **At the edge of the sweep's grid:** {', '.join(lr['edge'])}: the "
                     f"lowest val loss was the grid's first or last lr, so the best lr may lie "
                     f"beyond what was tried, and the arm may be under-tuned against the others.")
    else:
        L.append("- Learning rates: the experiment's recipe (not tuned by a sweep).")
    if rep["incomplete"]:
        L.append(f"- Runs excluded from every number below (unfinished or without a finite "
                 f"final loss): {len(rep['incomplete'])}, listed at the end.")
    return L + [""]


def _results(rep: dict) -> list[str]:
    base = rep["baseline"]
    L = ["## Results", ""]
    if base:
        L.append(f"Baseline: **{base}**. Δ = 100·(arm − {base}) / {base} per seed, then mean "
                 f"and paired 95% t-interval over the seeds both arms share (negative = lower "
                 f"than {base}). Brackets: 95% intervals over seeds.")
    L.append("")
    head = ["arm", "query", "MLP width", "params total", "params non-embedding",
            f"{rep['split']} log-loss [95% CI]", "perplexity (mean)", "Δ log-loss % [paired CI]",
            "Δ perplexity % [paired CI]", "final val log-loss", "lr", "seeds (spikes)",
            "tokens per run"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    for r in rep["arms"]:
        is_base = r["arm"] == base
        vs = r.get("vs_baseline")
        name = r["arm"] + (f" ({r['label']})" if r["label"] and r["label"] != r["arm"] else "")
        name += " (qk-norm)" if r["qk_norm"] and "qk" not in name.lower() else ""
        cells = [name, r["query"], str(r["mlp_width"]),
                 _params_cell(r, "params_total", is_base),
                 _params_cell(r, "params_non_embedding", is_base),
                 _loss_cell(r["loss"]), f"{r['ppl_mean']:.3f}",
                 "baseline" if is_base else (_delta_cell(vs["log_loss_pct"]) if vs else "–"),
                 "baseline" if is_base else (_delta_cell(vs["ppl_pct"]) if vs else "–"),
                 f"{r['val_loss']['mean']:.4f}", f"{r['lr']:.3g}",
                 f"{r['n_seeds']} ({sum(r['n_spikes'])} spikes)" if sum(r["n_spikes"])
                 else str(r["n_seeds"]), _int(r["tokens_per_run"])]
        L.append("| " + " | ".join(cells) + " |")
    return L + [""]


def _preregistered(rep: dict) -> list[str]:
    comps = rep.get("preregistered") or []
    if not comps and not rep.get("positive_control"):
        return []
    L = ["## Pre-registered comparisons", ""]
    c = rep.get("positive_control")
    rows = ([("positive control", c)] if c else []) + [("pre-registered", x) for x in comps]
    L += [("| comparison | role | seeds | Δ log-loss % | paired 95% CI | half-width | sd of "
          "paired Δ | detectable (80% power) | bootstrap 95% (seeds x test units) | Holm p | "
          "Holm-adjusted CI |"),
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for role, x in rows:
        name = f"{x['arm']} vs {x['against']}"
        if "ci95" not in x:
            L.append(f"| {name} | {role} | {x['n_seeds']} | – | {x.get('problem', '–')} "
                     f"| – | – | – | – | – | – |")
            continue
        b = x.get("bootstrap")
        L.append(f"| {name} | {role} | {x['n_seeds']} | {x['mean_pct']:+.3f} | "
                 f"[{x['ci95'][0]:+.3f}, {x['ci95'][1]:+.3f}] | {x['half_width_95_pct']:.3f} | "
                 f"{x['sd_pct']:.3f} | "
                 + (f"{x['detectable_80_pct']:.3f}" if x.get("detectable_80_pct") is not None
                    else "–") + " | "
                 + (f"[{b['lo']:+.3f}, {b['hi']:+.3f}]" if b else "–") + " | "
                 + (f"{x['p_holm']:.3g}" if "p_holm" in x else "–") + " | "
                 + (f"[{x['ci_holm'][0]:+.3f}, {x['ci_holm'][1]:+.3f}]" if "ci_holm" in x
                    else "–") + " |")
    boots = {(x["bootstrap"].get("unit", "documents"), x["bootstrap"].get("n_units"))
             for _, x in rows if x.get("bootstrap")}
    units = "; ".join(f"{u} ({n:,} of them)" if n else u for u, n in sorted(boots, key=str))
    boot = (f"The bootstrap resamples seeds and, independently, test units (one draw of units "
            f"per replicate, for every seed and both arms: every run is scored on the same "
            f"test split): {units}. " if units else
            "No bootstrap: the runs recorded no per-unit test losses. ")
    L += ["", ("Δ = 100·(arm − against)/against per seed (negative = arm lower). "
          "Half-width: of the paired 95% t-interval. Detectable: the smallest true "
          "difference these seeds would find with 80% power at the 95% level, from the sd of "
          "paired Δ (a planning figure; Holm's stricter levels need more). " + boot +
          "Holm corrects the pre-registered comparisons for their number: they are the "
          "family of every verdict this report gives."), ""]
    return L


def _stability(rep: dict) -> list[str]:
    return _spikes(rep) + _outliers(rep)


def _outliers(rep: dict) -> list[str]:
    far = rep.get("outliers") or []
    if not far:
        return []
    L = [(f"{len(far)} run(s) ended far above their arm's others: final loss more than "
          f"{OUTLIER_Z:g} robust sds (1.4826 x the median absolute deviation of the arm's "
          f"final losses) above the arm's median. They are kept in every statistic above; a "
          f"wide interval next to one of them comes from it."), ""]
    L += [f"- {o['arm']} seed {o['seed']}: {o['loss']:.4f} (arm median {o['median']:.4f}, "
          f"robust z {o['robust_z']:.0f})" for o in far]
    return L + [""]


def _spikes(rep: dict) -> list[str]:
    L = ["## Stability", ""]
    flagged = rep.get("stability") or []
    if not flagged:
        return L + [("No loss or grad-norm spike in any run (spike: train loss above 1.5x, or "
                    "grad norm above 10x, the running median of the previous 50 steps)."), ""]
    def in_warmup(s: dict, x: dict) -> bool:
        return s.get("warmup_steps") is not None and x["step"] < s["warmup_steps"]

    spikes = [(s, x) for s in flagged for x in s["spikes"]]
    late = [x for s, x in spikes if not in_warmup(s, x)]
    n_loss = sum(x["kind"] == "loss" for _, x in spikes)
    L.append(f"{len(spikes)} spike(s) in {len(flagged)} run(s): {n_loss} of train loss, "
             f"{len(spikes) - n_loss} of grad norm; {len(spikes) - len(late)} inside the lr "
             f"warmup (where the grad norm swings while the loss leaves its first plateau), "
             f"{len(late)} after it. A spike is a train loss above 1.5x, or a grad norm above "
             f"10x, the running median of the previous 50 steps.")
    L.append("")
    for s in flagged:
        steps = ", ".join(f"{x['step']} ({x['kind']}{', warmup' if in_warmup(s, x) else ''})"
                          for x in s["spikes"][:10])
        L.append(f"- {s['arm']} seed {s['seed']}: {s['n_spikes']} spike(s) at step {steps}")
    return L + [""]


JUDGED = ("holds", "contradicted", "unresolved")  # an ordering status read from verdicts
SURVIVES = ("yes", "no, it is worse", "not shown", "undetermined")  # the same for QK-norm


def answer_lines(rep: dict) -> tuple[list[str], list[str]]:
    """(verdicts, descriptions): the pre-registered verdicts and what is read from them (the
    declared ordering, the QK-norm question), and every other comparison, described."""
    arms = [r["descriptive"] for r in rep["arms"] if "descriptive" in r]
    if not rep.get("verdicts_allowed", True):
        return [], arms
    arms = [r["descriptive"] for r in rep["arms"]  # those pre-registered are judged
            if "descriptive" in r and not r.get("preregistered")]
    judged, described = list(rep.get("preregistered_verdicts", [])), []
    o = rep["ordering"]
    if o:
        (judged if o.get("status") in JUDGED else described).append(o["answer"])
    for s in rep["strong_baseline"]:
        (judged if s["survives"] in SURVIVES else described).append(s["answer"])
    return judged, described + arms


def _verdicts(rep: dict) -> list[str]:
    judged, described = answer_lines(rep)
    if not rep.get("verdicts_allowed", True):
        why = ("the positive control does not survive a change of summation order"
               if (rep.get("numerical_noise") or {}).get("control_unstable")
               else "the positive control failed")
        L = [f"## Differences (descriptive only: no verdict, {why})", ""]
        return L + [f"- {_end(d)}" for d in described] + [""]
    L = ["## Verdicts", ""]
    L += [f"- {_end(v)}" for v in judged] or [
        "- None: the experiment pre-registers no comparison."]
    L += ["", "Described, not judged (outside the Holm family):", ""]
    L += [f"- {_end(d)}" for d in described] or ["- Nothing else to compare."]
    return L + [""]


def _end(x: str) -> str:
    return x if x.endswith(".") else x + "."


def _reference(p: dict) -> list[str]:
    """The published figures the experiment declares (nlq.report.claims), as one table."""
    L = ["## The paper's figures (another scale: not comparable one-to-one)", "",
         f"{p['cite']}; {p['setting']}.", "",
         "| version | arm | val log-loss | Δ log-loss % vs baseline | Δ perplexity % |",
         "|---|---|---|---|---|"]
    for e in p["figures"]:
        loss = f"{e['val_loss']:.3f}" if "val_loss" in e else "–"
        d = ("baseline" if e.get("baseline") else
             f"{e['log_loss_pct']:+.2f}" if "log_loss_pct" in e else "–")
        ppl = f"{e['ppl_pct']:+.2f}" if "ppl_pct" in e else "–"
        L.append(f"| {e['version']} | {e['arm']} | {loss} | {d} | {ppl} |")
    return L + [""]


def _int(x) -> str:
    return f"{x:,}" if isinstance(x, int) else ("varies: " + ", ".join(f"{v:,}" for v in x)
                                                if isinstance(x, list) else "?")


def _params_cell(row: dict, key: str, is_base: bool) -> str:
    pct = row.get(f"{key}_vs_baseline_pct")
    if is_base or pct is None:
        return _int(row[key])
    return f"{_int(row[key])} ({pct:+.3f}%)"


def _loss_cell(e: dict) -> str:
    if e["lo"] is None:
        return f"{e['mean']:.4f} (1 seed, no CI)"
    return f"{e['mean']:.4f} [{e['lo']:.4f}, {e['hi']:.4f}]"


def _delta_cell(e: dict | None) -> str:
    if e is None:
        return "no common seed"
    if e["lo"] is None:
        return f"{fmt_signed(e['mean'])} (1 seed, no CI)"
    return f"{fmt_signed(e['mean'])} [{fmt_signed(e['lo'])}, {fmt_signed(e['hi'])}]"
