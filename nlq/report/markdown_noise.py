"""The sections of report.md (nlq.report.markdown) on how settled its numbers are: numerical
noise, what a change of float summation order moves (nlq.report.noise), and convergence, how
far the val loss was still falling at the end (nlq.report.convergence)."""

from __future__ import annotations

from nlq.report.noise import share_text


def noise_section(rep: dict) -> list[str]:
    """Numerical noise: what summed the floats, and how much a change of order moves."""
    n = rep.get("numerical_noise")
    if n is None:
        return []
    L = ["## Numerical noise (float summation order)", ""]
    groups: dict[tuple, int] = {}
    for r in n["runs"]:
        key = ("replicate" if r["replicate"] else "primary", _rec(r["threads"]), _rec(r["isa"]),
               _rec(r["cpu"]))
        groups[key] = groups.get(key, 0) + 1
    L += ["| runs | role | threads | ISA | CPU |", "|---|---|---|---|---|"]
    L += [f"| {k} | {role} | {t} | {isa} | {cpu} |"
          for (role, t, isa, cpu), k in sorted(groups.items(), key=str)]
    L += ["", (f"Machines: {', '.join(n['machines'])}; ISA paths: {', '.join(n['isas'])} (each "
          f"run's in report.json). The same config gives the same bits only at the same "
          f"thread count on the same ISA."), ""]
    L += machine_lines(rep)
    if not n["measured"]:
        return L + [("Rounding noise was not measured: no run was trained again at another "
                     "thread count. A run's final loss is a chaotic function of the order its "
                     "floats are summed in, so part of the seed-to-seed spread may be rounding. "
                     "Measure it with `nlq reproduce ... --replicates K --replicate-threads M` "
                     "(seeds 0..K-1 of every arm trained again at M threads; the report sets "
                     "each beside its primary run)."), ""]
    d = n["run_diff_pct"]
    L += [("| arm | seed | threads (primary → replicate) | primary | replicate | "
          "replicate − primary, % |"), "|---|---|---|---|---|---|"]
    L += [f"| {x['arm']} | {x['seed']} | {_rec(x['primary_threads'])} → {x['threads']} | "
          f"{x['primary_loss']:.6f} | {x['replicate_loss']:.6f} | {x['diff_pct']:+.3g} |"
          for x in n["replicates"]]
    sd = f", sd {d['sd']:.3g}%" if d["sd"] is not None else ""
    L += ["", (f"Replicate − primary over {d['n']} run(s), in % of log-loss: RMS "
          f"{d['rms']:.3g}%{sd}, mean {d['mean']:+.3g}%; {n['identical']} of "
          f"them bit-identical to their primary run."), ""]
    if n["comparisons"]:
        L += [("| comparison | role | replicated seeds | change of paired Δ per seed, % | RMS "
              "of change | sd of change | seed-to-seed sd of paired Δ | rounding share of "
              "variance |"), "|---|---|---|---|---|---|---|---|"]
        for c in n["comparisons"]:
            ch = c["change_pct"]
            per = ", ".join(f"{x['change_pct']:+.3g}" for x in c["per_seed"]) or "–"
            L.append(f"| {c['arm']} vs {c['against']} | {c['role']} | {ch['n']} | {per} | "
                     + (f"{ch['rms']:.3g}" if ch["n"] else "–") + " | "
                     + (f"{ch['sd']:.3g}" if ch["sd"] is not None else "–") + " | "
                     + (f"{c['seed_sd_pct']:.3g}" if c["seed_sd_pct"] is not None else "–")
                     + " | " + (share_text(c["share"]).removesuffix(" of")
                                if c["share"] is not None else "–")
                     + " |")
        L += ["", ("Change: the paired Δ with both arms' replicates minus the paired Δ with "
                   "their primary runs. Rounding share: (RMS of change)² / 2 over the seed-to-seed "
                   "variance of the paired Δ (the change holds the rounding noise of two "
                   "orders)."), ""]
    if n.get("share_answer"):
        L += [n["share_answer"], ""]
    for s in n["swapped"]:
        L += [(f"Verdicts with seed(s) {', '.join(map(str, s['seeds']))} replaced by their "
              f"replicates at {s['threads']} threads:"), ""]
        c = s.get("control")
        if c:
            L.append(f"- positive control {c['arm']} vs {c['against']}: "
                     f"{'passes' if c['primary'] else 'fails'} → "
                     f"{'passes' if c['swapped'] else 'fails'}"
                     + (" (**changes**)" if s["control_changed"] else " (unchanged)"))
        for x in s["comparisons"]:
            L.append(f"- {x['arm']} vs {x['against']}: {_OUTCOME[x['primary']]} → "
                     f"{_OUTCOME[x['swapped']]}"
                     + (" (**changes**)" if x["primary"] != x["swapped"] else " (unchanged)"))
        L.append("")
    return L


def _group_name(g: dict) -> str:
    return f"{g['cpu']}, {g['isa']}, {g['threads']} thread(s)"


def machine_lines(rep: dict) -> list[str]:
    """The control and the pre-registered comparisons on each machine's runs alone
    (nlq.report.noise.by_machine), where the runs come from more than one."""
    groups = (rep.get("numerical_noise") or {}).get("by_machine") or []
    if not groups:
        return []
    L = ["| comparison | role | " + " | ".join(f"{_group_name(g)} ({g['n_runs']} runs)"
                                               for g in groups) + " |",
         "|---|---|" + "---|" * len(groups)]
    for i, c in enumerate(groups[0]["comparisons"]):
        cells = []
        for g in groups:
            x = g["comparisons"][i]
            if "mean_pct" not in x:
                cells.append(f"– ({x['n_seeds']} seeds)")
                continue
            holm = f", Holm p {x['p_holm']:.2g}" if "p_holm" in x else ""
            cells.append(f"{x['mean_pct']:+.2f}% [{x['ci95'][0]:+.2f}, {x['ci95'][1]:+.2f}] "
                         f"({x['n_seeds']} seeds{holm}): {_GROUP_OUTCOME[x['outcome']]}")
        L.append(f"| {c['arm']} vs {c['against']} | {c['role']} | " + " | ".join(cells) + " |")
    return L + ["", machine_answer(rep), ""]


def machine_answer(rep: dict) -> str:
    """One sentence: whether the verdicts hold on each machine's runs alone ("" where the
    runs come from one machine)."""
    groups = (rep.get("numerical_noise") or {}).get("by_machine") or []
    if not groups:
        return ""
    head = ("Each machine's runs alone (a pair keeps the seeds both its arms ran there; Holm "
            "within each machine; a description beside the verdicts, with fewer seeds than "
            "the whole): ")
    if not rep.get("verdicts_allowed"):
        return head + "shown for the record; the whole gives no verdict to check."
    rev = [f"{x['arm']} vs {x['against']} on {_group_name(g)}" for g in groups
           for x in g["comparisons"] if x.get("reversed")]
    weak = [f"{x['arm']} vs {x['against']} ({_GROUP_OUTCOME[x['whole']]} on the whole) on "
            f"{_group_name(g)} ({x['n_seeds']} seeds)" for g in groups
            for x in g["comparisons"] if "whole" in x and x["whole"] != x["outcome"]
            and not x.get("reversed")]
    text = (f"**reverses** for {'; '.join(rev)}: such a verdict does not survive a change of "
            f"machine." if rev else "no verdict reverses on any machine.")
    if weak:
        text += (" Not reached there (power or a real difference between machines: these "
                 "seeds cannot tell): " + "; ".join(weak) + ".")
    return head + text


_OUTCOME = {"beats": "beats", "worse": "worse", "none": "no detectable difference",
            "no verdict": "no verdict"}
_GROUP_OUTCOME = _OUTCOME | {"passes": "passes", "fails": "fails"}  # the control's, too


def _rec(x) -> str:
    return "not recorded" if x is None else str(x)


def convergence_section(rep: dict) -> list[str]:
    """Convergence: how fast each arm's val loss was still falling over its runs' last steps."""
    c = rep.get("convergence")
    if not c:
        return []
    L = ["## Convergence", "",
         "| arm | seeds | val-loss slope per 1,000 steps | fall over the span, % | span |",
         "|---|---|---|---|---|"]
    for a in c["arms"]:
        if not a["n_seeds"]:
            L.append(f"| {a['arm']} | 0 | – | – | fewer than two evals |")
            continue
        L.append(f"| {a['arm']} | {a['n_seeds']} | {a['slope_per_1k']:+.4f} | "
                 f"{a['fall_pct']:.3f} | steps {a['from_step']:,}.. ({a['span_steps']:.0f} "
                 f"steps) |")
    L += ["", (f"Least-squares slope of val log-loss over the last {100 * c['window']:.0f}% of "
               f"each run's steps (its last two evals where that span holds fewer), mean over "
               f"seeds; the fall is in % of the final val loss. {c['answer']}"), ""]
    return L


def logits_section(rep: dict) -> list[str]:
    """The attention logits' range at the end of training, per arm (what a QK-norm arm's bound
    and its scale leave the softmax: README, "The study")."""
    rows = rep.get("attention_logits")
    if not rows:
        return []
    L = ["## Attention logits at the end of training", "",
         "| arm | seeds | largest \\|logit\\| (mean over seeds) | largest over seeds | logit sd |",
         "|---|---|---|---|---|"]
    for a in rows:
        L.append(f"| {a['arm']} | {a['n_seeds']} | {a['max_abs_mean']:.2f} | "
                 f"{a['max_abs_max']:.2f} | {a['sd_mean']:.2f} |")
    L += ["", (f"Pre-softmax logits q·k·scale over the positions each query may attend, on the "
               f"first {rows[0]['rows']} val sequences; per run the largest over its layers, "
               f"and the sd mean over layers. A QK-norm arm's |logit| is at most "
               f"sqrt(head size) x the scale multiplier x its norms' gains."), ""]
    return L
