"""The study report: every finished rung's comparison side by side (study.md, study.json) and
the scale figure (scale.png: each arm's Δ test log-loss vs the baseline, with its paired 95%
interval, against the baseline's non-embedding parameters). It only gathers what each rung's
own report (OUT/<rung>/compare/report.json) measured and concluded; a rung whose positive
control did not pass is shown, marked as unable to test the claim."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nlq import runfiles
from nlq.experiments.ladder import RUNG_FILE, rung_record
from nlq.extras import need
from nlq.fsutil import write_atomic
from nlq.runfiles import read_summary
from nlq.sysinfo import cpu_name


def rung_rows(ladder, out: Path) -> list[dict]:
    rows = []
    for name, rung in ladder.rungs.items():
        path = out / name / "compare" / "report.json"
        if not path.is_file():
            rows.append({"rung": name, "description": rung.description,
                         "status": "not finished"})
            continue
        try:  # a rung edited since its runs: their numbers are not the ladder's rung
            before = json.loads((out / name / RUNG_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            before = None
        now = rung_record(ladder, rung)
        if isinstance(before, dict) and before != now:
            keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
            rows.append({"rung": name, "description": rung.description, "status": "changed",
                         "changed": keys})
            continue
        try:
            rep = json.loads(path.read_text(encoding="utf-8"))
            base = next(a for a in rep["arms"] if a["arm"] == rep["baseline"])
        except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
            # the rung's `nlq reproduce` writes it again when the study continues
            print(f"nlq: warning: {path} is not a report `nlq reproduce` wrote ({e!r}): rung "
                  f"{name} is shown as not finished", file=sys.stderr)
            rows.append({"rung": name, "description": rung.description,
                         "status": "not finished"})
            continue
        arms = {}
        for a in rep["arms"]:
            d = (a.get("vs_baseline") or {}).get("log_loss_pct") or {}
            arms[a["arm"]] = {"loss": a["loss"]["mean"], "n_seeds": a["n_seeds"], "lr": a["lr"],
                              "params_non_embedding": a["params_non_embedding"],
                              "delta_pct": d.get("mean"), "ci95": [d.get("lo"), d.get("hi")]}
        control = rep.get("positive_control") or {}
        rows.append({
            "rung": name, "description": rung.description, "status": "done",
            "baseline": rep["baseline"], "params_non_embedding": base["params_non_embedding"],
            "tokens_per_run": base["tokens_per_run"], "arms": arms,
            # None: the experiment declares no positive control (verdicts need none)
            "control_passed": (bool(rep.get("verdicts_allowed"))
                               if rep.get("positive_control") else None),
            "verdicts_allowed": bool(rep.get("verdicts_allowed")),
            "lr_at_edge": (rep.get("lrs") or {}).get("edge") or [],
            "control": {k: control.get(k) for k in ("arm", "against", "mean_pct", "ci95",
                                                    "half_width_95_pct", "n_seeds")},
            "first_line": rep.get("first_line"),
            "verdicts": rep.get("preregistered_verdicts") or [],
            "preregistered": [{k: c.get(k) for k in ("arm", "against", "n_seeds", "mean_pct",
                                                     "ci95", "p_holm")}
                              for c in rep.get("preregistered") or []],
            "strong_baseline": rep.get("strong_baseline"),
            "lrs": (rep.get("lrs") or {}).get("lrs"),
            "cost": _cost(out / name),
        })
    return rows


def _cost(rung_dir: Path) -> dict:
    """The rung's finished runs (sweep and seeds) and their summed training seconds (two at a
    time on CPU: the wall time is about half)."""
    summaries = [read_summary(p.parent)[0] for p in rung_dir.rglob(runfiles.SUMMARY)]
    secs = [s.get("elapsed_s") if isinstance(s.get("elapsed_s"), (int, float)) else 0.0
            for s in summaries if s is not None]  # a broken summary is not a finished run
    return {"runs": len(secs), "run_seconds": round(sum(secs))}


def machine() -> dict:
    import os

    import torch

    from nlq.experiments.sweep import source_commit

    sha, dirty = source_commit()
    return {"commit": sha, "dirty": dirty, "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _fmt(x: float | None, spec: str = "+.2f") -> str:
    return "–" if x is None else format(x, spec)


def render(rows: list[dict], ladder, m: dict) -> str:
    done = [r for r in rows if r["status"] == "done"]
    arms = [a for a in ladder.arms if any(a in r["arms"] for r in done)] or sorted(
        {a for r in done for a in r["arms"]})
    L = ["# nlq study: the comparison across model sizes", "",
         (f"Experiment `{load_name(ladder)}`; each rung is a full comparison (lr sweep on val "
          f"for every arm, seeds at the chosen lrs, test split, positive control first; its "
          f"own report in `<rung>/compare/report.md`). Δ = log-loss % vs the baseline per "
          f"seed, mean [paired 95% CI]."), ""]
    L.append("| " + " | ".join(["rung", "model", "non-emb. params (baseline)",
                                "tokens / run (per non-emb. param)", "seeds", "control",
                                *arms]) + " |")
    L.append("|---" * (6 + len(arms)) + "|")
    costs = []
    for r in rows:
        if r["status"] != "done":
            why = ("**changed since its runs** (" + ", ".join(r["changed"]) + "): not shown"
                   if r["status"] == "changed" else "not finished")
            L.append(f"| {r['rung']} | {r['description']} | | | | {why} |" + " |" * len(arms))
            continue
        cells = []
        for a in arms:
            v = r["arms"].get(a)
            if v is None:
                cells.append("–")
            elif a == r["baseline"]:
                cells.append(f"{v['loss']:.4f} (baseline)")
            else:
                lo, hi = v["ci95"]
                cells.append(f"{v['loss']:.4f}, {_fmt(v['delta_pct'])}% "
                             f"[{_fmt(lo)}, {_fmt(hi)}]")
        n = min(v["n_seeds"] for v in r["arms"].values())
        ctrl = ("none declared" if r["control_passed"] is None else "passed"
                if r["control_passed"] else "**failed: cannot test the claim**")
        tpp = r["tokens_per_run"] / r["params_non_embedding"]
        L.append(f"| {r['rung']} | {r['description']} | {r['params_non_embedding']:,} | "
                 f"{r['tokens_per_run'] / 1e6:.2f}M ({tpp:.1f} per param) | {n} | {ctrl} | "
                 + " | ".join(cells) + " |")
        costs.append(f"{r['rung']}: {r['cost']['runs']} runs, "
                     f"{r['cost']['run_seconds'] / 3600:.1f} h of training summed over runs")
    L += ["", (f"Cost: {'; '.join(costs) or 'nothing run'}. Report written at commit "
          f"{(m['commit'] or 'unknown')[:10]}{' (dirty)' if m['dirty'] else ''} on "
          f"{m['cuda'] or m['cpu']} ({m['cpu_count']} CPUs), torch {m['torch']}.")]
    L += ["", "## What each rung concluded", ""]
    for r in done:
        L.append(f"- **{r['rung']}**: {r['first_line'] or 'No positive control declared.'}")
        if r["lr_at_edge"]:
            L.append(f"  - lr at the edge of the sweep's grid for {', '.join(r['lr_at_edge'])}: "
                     f"the best lr may lie beyond what was tried (`{r['rung']}/compare/report.md`)")
        if r.get("verdicts_allowed", r["control_passed"]):
            L += [f"  - {v}" for v in r["verdicts"]]
        else:  # the pre-registered pairs still have numbers: given, judged by none
            L += [f"  - {c['arm']} vs {c['against']} (pre-registered; described, no verdict): "
                  f"{_fmt(c['mean_pct'])}% [{_fmt((c['ci95'] or [None, None])[0])}, "
                  f"{_fmt((c['ci95'] or [None, None])[1])}], {c['n_seeds']} seeds, Holm p "
                  f"{_fmt(c['p_holm'], '.3g')}" for c in r.get("preregistered") or []]
        given = {(c["arm"], c["against"]) for c in r.get("preregistered") or []}
        for s in r.get("strong_baseline") or []:
            if not (isinstance(s, dict) and s.get("answer")):
                continue
            if not r.get("verdicts_allowed", r["control_passed"]) and \
                    (s["nonlinear"], s["strong_baseline"]) in given:
                continue  # no verdict to combine: the pair's numbers are in the line above
            L.append(f"  - {s['answer']}")
    not_run = [r["rung"] for r in rows if r["status"] == "not finished"]
    if not_run:
        L += ["", (f"Not finished: {', '.join(not_run)} (`nlq study --rungs "
                   f"{','.join(not_run)}`).")]
    changed = [r["rung"] for r in rows if r["status"] == "changed"]
    if changed:
        L += ["", (f"Changed in the ladder since their runs: {', '.join(changed)}; their runs "
                   f"answer the rung as it was (its `rung.json`), so they are not shown here: "
                   f"restore the rung, or name the new one differently.")]
    L += ["", "![scale](scale.png)", ""]
    return "\n".join(L) + "\n"


def load_name(ladder) -> str:
    from nlq.experiments.experiment import load_experiment

    return load_experiment(ladder.experiment).name


def budget(row: dict) -> float:
    """A finished rung's tokens per non-embedding parameter of its baseline, to 0.1."""
    return round(row["tokens_per_run"] / row["params_non_embedding"], 1)


def token_budgets(done: list[dict]) -> tuple[float | None, dict[float, int]]:
    """(the budget most finished rungs share, the lower on a tie; rungs per budget)."""
    counts: dict[float, int] = {}
    for r in done:
        counts[budget(r)] = counts.get(budget(r), 0) + 1
    return (max(counts, key=lambda b: (counts[b], -b)) if counts else None), counts


def draw_scale(rows: list[dict], path: Path) -> None:
    matplotlib = need("matplotlib", "the scale figure")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    done = [r for r in rows if r["status"] == "done"]
    arms = sorted({a for r in done for a in r["arms"] if a != r["baseline"]})
    # a line joins the rungs of one token budget (tokens per parameter) only: rungs of another
    # budget (S0 beside S0-short, the same model) are points of their own, squares
    main, counts = token_budgets(done)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, a in enumerate(arms):
        color = colors[i % len(colors)]
        for b in sorted(counts, key=lambda b: b != main):
            pts = [(r["params_non_embedding"], r["arms"][a], r["control_passed"]) for r in done
                   if budget(r) == b and a in r["arms"] and r["arms"][a]["delta_pct"] is not None]
            if not pts:
                continue
            # a small horizontal offset per arm keeps the error bars apart
            xs = [p * (1 + 0.04 * (i - len(arms) / 2)) for p, _, _ in pts]
            ys = [v["delta_pct"] for _, v, _ in pts]
            err = [[y - (v["ci95"][0] if v["ci95"][0] is not None else y) for y, (_, v, _) in
                    zip(ys, pts, strict=True)],
                   [(v["ci95"][1] if v["ci95"][1] is not None else y) - y for y, (_, v, _) in
                    zip(ys, pts, strict=True)]]
            ax.errorbar(xs, ys, yerr=err, marker="o" if b == main else "s", capsize=3,
                        color=color, linestyle="-" if b == main else "none",
                        label=a if b == main else None)
            for x, y, (_, _, ok) in zip(xs, ys, pts, strict=True):
                if ok is False:  # the control failed here: the point cannot test the claim
                    ax.plot(x, y, marker="x", color=color, markersize=12)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    xs = sorted({r["params_non_embedding"] for r in done})
    if xs:  # one tick per size, labelled with it and its rungs; room for the offsets around it
        ax.set_xlim(xs[0] / 1.6, xs[-1] * 1.6)
        names = {x: "/".join(r["rung"] for r in done if r["params_non_embedding"] == x)
                 for x in xs}
        ax.set_xticks(xs, [(f"{x / 1e3:.0f}k" if x < 1e6 else f"{x / 1e6:.1f}M") + "\n"
                           + names[x] for x in xs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("non-embedding parameters of the baseline")
    ax.set_ylabel("Δ test log-loss vs baseline (%), paired 95% CI")
    other = ", ".join(f"{b:g}" for b in sorted(counts) if b != main)
    ax.set_title("nlq study (x: positive control failed"
                 + (f"; squares: {other} tokens/param, lines: {main:g}" if other else "")
                 + ")", fontsize=9)
    if arms:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_study_report(ladder, out: Path) -> dict:
    rows = rung_rows(ladder, out)
    out.mkdir(parents=True, exist_ok=True)
    rep = {"experiment": load_name(ladder), "arms": ladder.arms, "machine": machine(),
           "rungs": rows}
    write_atomic(out / "study.json", json.dumps(rep, indent=2) + "\n")
    write_atomic(out / "study.md", render(rows, ladder, rep["machine"]))
    draw_scale(rows, out / "scale.png")
    print(f"study: wrote {out / 'study.md'}, {out / 'study.json'}, {out / 'scale.png'}")
    return rep
