"""report.md from report.json's content (nlq.eval.summary.summarize): one function per
section, in the order they appear."""

from __future__ import annotations

import json

from nlq.eval.summary import fmt_signed


def render_markdown(rep: dict, fig_name: str | None = "fig1.png") -> str:
    L = [f"# {rep['title']}", ""]
    L += _measured(rep) + _results(rep) + _verdicts(rep)
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
    L.append(f"- Metric: {m['metric']}, on {m['val_sequences']} fixed validation sequences of "
             f"{m['block_size']} tokens; perplexity = exp(log-loss).")
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
            uni = rep["data"].get("unigram_val_loss", {}).get(d)
            if uni is not None:
                L.append(f"- Reference: a unigram model (token frequencies of the train split) "
                         f"scores val log-loss {uni:.4f} on this data; a run that learned "
                         f"nothing beyond frequencies would sit there.")
        else:
            L.append(f"- Data: `{d}` (its meta.json is not readable from here).")
    L.append(f"- Runs: {m['n_finished_runs']} finished, over {m['n_arms']} arm(s); seeds per "
             f"arm: " + ", ".join(f"{r['arm']} {r['n_seeds']}" for r in rep["arms"]) + ".")
    tok = {json.dumps(r["tokens_per_run"]): r for r in rep["arms"]}
    for r in tok.values():
        L.append(f"- Tokens per run: {_int(r['tokens_per_run'])} ({_int(r['steps'])} steps x "
                 f"{_int(r['tokens_per_step'])} tokens per step)"
                 + ("" if len(tok) == 1 else f" for arm {r['arm']} and those with the same") + ".")
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
            "val log-loss [95% CI]", "perplexity (mean)", "Δ log-loss % [paired CI]",
            "Δ perplexity % [paired CI]", "seeds", "tokens per run"]
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
                 _loss_cell(r["val_loss"]), f"{r['val_ppl_mean']:.3f}",
                 "baseline" if is_base else (_delta_cell(vs["log_loss_pct"]) if vs else "–"),
                 "baseline" if is_base else (_delta_cell(vs["ppl_pct"]) if vs else "–"),
                 str(r["n_seeds"]), _int(r["tokens_per_run"])]
        L.append("| " + " | ".join(cells) + " |")
    return L + [""]


def _verdicts(rep: dict) -> list[str]:
    L = ["## Verdicts", ""]
    verdicts = [r["verdict"] for r in rep["arms"] if "verdict" in r]
    L += [f"- {v}." for v in verdicts] or ["- A single arm: nothing to compare."]
    if rep["ordering"]:
        L.append(f"- {rep['ordering']['answer']}")
    for s in rep["strong_baseline"]:
        L.append(f"- {s['answer']}")
    return L + [""]


def _reference(p: dict) -> list[str]:
    """The published figures the experiment declares (nlq.eval.claims), as one table."""
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
