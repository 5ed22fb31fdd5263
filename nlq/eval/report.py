"""The report of an experiment: statistics over seeds, report.md / report.json, and Fig. 1.

Input: run folders written by the trainer (config.toml, metrics.jsonl, summary.json when
finished) and the experiment runner (arm.json: experiment, arm, seed_index, label). A run
without arm.json belongs to the arm named by its parent folder, its seed is train.seed.

Only finished runs (summary.json with status "finished") enter the statistics; the others
are listed as incomplete with the reason. Arms are compared to the baseline seed by seed
(nlq.eval.stats.paired): the paper ran one seed per arm, so every claim here is sized by
the paired 95% t-interval, and a single seed is reported as a single observation.

Fig. 1 follows the paper's (PAPER.md): top, val log-loss against steps per arm; bottom,
improvement over the baseline in % against steps (positive = lower loss than baseline).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nlq.config import Config, load_config
from nlq.errors import NlqError
from nlq.eval.stats import LEVEL, Estimate, Paired, mean_ci, paired

# The paper's own numbers (PAPER.md): another scale, shown beside ours, never mixed in.
PAPER = {
    "cite": "Karbevski 2026, \"Beyond Linearity in Attention Projections: The Case for "
            "Nonlinear Queries\", arXiv 2603.13381",
    "setting": "GPT-3 small (124M), OpenWebText, GPT-2 BPE, 60,002 steps x 491,520 tokens "
               "(~29.5B tokens), 1 seed per arm",
    "v3_final": {"arm": "nonlinear", "log_loss_pct": -2.40, "ppl_pct": -6.81},
    "v1_step_59k": [
        {"arm": "linear (baseline)", "val_loss": 2.956, "log_loss_pct": None},
        {"arm": "linear+12.5%", "val_loss": 2.927, "log_loss_pct": -0.98},
        {"arm": "nonlinear", "val_loss": 2.919, "log_loss_pct": -1.24},
        {"arm": "nonlinear, tuned lr/wd", "val_loss": 2.915, "log_loss_pct": -1.40},
    ],
}


# ---------------------------------------------------------------------------------------
# collecting runs


@dataclass
class Run:
    dir: Path
    arm: str
    seed: int | str
    """arm.json's seed_index if given, else train.seed: runs of two arms with the same seed
    are paired."""
    label: str | None = None
    experiment: str | None = None
    cfg: Config | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)
    """(step, val_loss), sorted; for a step logged twice (a resumed run) the later line wins."""
    summary: dict | None = None
    problem: str | None = None
    """Why the run is not in the statistics (None for a finished run)."""
    notes: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.problem is None

    @property
    def final_loss(self) -> float:
        return float(self.summary["val_loss"])

    @property
    def tokens_per_step(self) -> int | None:
        if self.cfg is None:
            return None
        t = self.cfg.train
        return t.micro_batch * t.grad_accum * self.cfg.model.block_size

    @property
    def tokens(self) -> int | None:
        if self.summary and "tokens" in self.summary:
            return int(self.summary["tokens"])
        if self.summary and "step" in self.summary and self.tokens_per_step:
            return int(self.summary["step"]) * self.tokens_per_step
        return None

    @property
    def last_step(self) -> int | None:
        return self.evals[-1][0] if self.evals else None


def find_runs(paths: Iterable[str | Path]) -> list[Path]:
    """Run folders (those holding config.toml) given run folders or experiment folders
    (runs/<arm>/seed<k>/ below them, or any run folder up to 3 levels down)."""
    found: dict[Path, None] = {}
    for p in map(Path, paths):
        if not p.exists():
            raise NlqError(f"run dir not found: {p}")
        if not p.is_dir():
            raise NlqError(f"{p} is not a folder (expected a run dir or an experiment dir)")
        if (p / "config.toml").is_file():
            found[p.resolve()] = None
            continue
        below = sorted(c.parent for depth in ("*", "*/*", "*/*/*")
                       for c in p.glob(f"{depth}/config.toml"))
        if not below:
            raise NlqError(f"no run in {p} (expected config.toml there, or "
                           f"runs/<arm>/seed<k>/config.toml below it)")
        for c in below:
            found[c.resolve()] = None
    return list(found)


def read_run(d: Path) -> Run:
    arm_info = _read_json(d / "arm.json")
    arm = str(arm_info.get("arm") or d.parent.name) if isinstance(arm_info, dict) else d.parent.name
    info = arm_info if isinstance(arm_info, dict) else {}
    run = Run(dir=d, arm=arm, seed="?", label=info.get("label"), experiment=info.get("experiment"))
    if arm_info is _BAD:
        run.notes.append("arm.json is not valid JSON: arm taken from the folder name")
    try:
        run.cfg = load_config(d / "config.toml")
    except NlqError as e:
        run.problem = f"config.toml unreadable: {e}"
        return run
    run.seed = info.get("seed_index", run.cfg.train.seed)
    run.evals, bad = _read_evals(d / "metrics.jsonl")
    if bad:
        run.notes.append(f"{bad} unreadable line(s) in metrics.jsonl skipped")
    summary = _read_json(d / "summary.json")
    if summary is None:
        at = f" (last eval at step {run.last_step})" if run.evals else " (no eval logged)"
        run.problem = "no summary.json: not finished" + at
    elif summary is _BAD or not isinstance(summary, dict):
        run.problem = "summary.json is not valid JSON"
    elif summary.get("status") != "finished":
        run.problem = f"summary.json status is {summary.get('status')!r}, not 'finished'"
    elif not isinstance(summary.get("val_loss"), (int, float)) or not math.isfinite(
            summary["val_loss"]):
        run.problem = (f"finished, but summary.json val_loss is {summary.get('val_loss')!r}, "
                       f"not a finite number (diverged?)")
    else:
        run.summary = summary
        if not run.evals:
            run.notes.append("no eval lines in metrics.jsonl: not drawn in Fig. 1")
        elif run.evals[-1][0] == summary.get("step") and not math.isclose(
                run.evals[-1][1], summary["val_loss"], rel_tol=1e-6):
            run.notes.append(f"final eval in metrics.jsonl ({run.evals[-1][1]:.6g}) differs "
                             f"from summary.json val_loss ({summary['val_loss']:.6g})")
    return run


_BAD = object()  # marker: the file exists but is not valid JSON


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _BAD


def _read_evals(path: Path) -> tuple[list[tuple[int, float]], int]:
    by_step: dict[int, float] = {}
    bad = 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # e.g. the last line of a run killed mid-write
            continue
        if isinstance(rec, dict) and rec.get("kind") == "eval":
            by_step[int(rec["step"])] = float(rec["val_loss"])
    return sorted(by_step.items()), bad


def collect(run_dirs: Iterable[str | Path]) -> list[Run]:
    """Every run under run_dirs (see find_runs), finished or not, in folder order."""
    runs = [read_run(d) for d in find_runs(run_dirs)]
    seen: dict[tuple, Path] = {}
    for r in runs:
        if r.finished:
            key = (r.arm, r.seed)
            if key in seen:
                raise NlqError(f"arm {r.arm!r} has two finished runs with seed {r.seed!r}: "
                               f"{seen[key]} and {r.dir} (pass only one of them)")
            seen[key] = r.dir
    return runs


# ---------------------------------------------------------------------------------------
# statistics


def _arm_order(arms: Sequence[str], baseline: str) -> list[str]:
    return sorted(set(arms), key=lambda a: (a != baseline, a))


def _final(runs: list[Run]) -> dict:
    return {r.seed: r.final_loss for r in runs}


def _config_diffs(runs: list[Run]) -> list[str]:
    """Config keys (other than the seeds and the device) that differ between an arm's runs."""
    from nlq.config import flatten

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
    losses = [r.final_loss for r in runs]
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
        "val_loss": mean_ci(losses).to_dict(),
        "val_ppl_mean": sum(ppls) / len(ppls),
        "per_seed": [{"seed": r.seed, "run_dir": str(r.dir), "val_loss": r.final_loss,
                      "val_ppl": math.exp(r.final_loss), "tokens": r.tokens} for r in runs],
        "config_differs_in": _config_diffs(runs),
    }
    if base_row is not None:
        for k in ("params_total", "params_non_embedding"):
            v, b = row[k], base_row[k]
            ok = isinstance(v, int) and isinstance(b, int)
            row[f"{k}_vs_baseline_pct"] = _pct_vs(v, b) if ok else None
    if base_runs is not None and name != baseline:
        pair = paired(_final(runs), _final(base_runs))
        row["vs_baseline"] = pair.to_dict()
        row["verdict"] = verdict(name, baseline, pair)
    return row


def _fmt_pct(x: float) -> str:
    return f"{abs(x):.2f}" if abs(x) >= 0.05 else f"{abs(x):.2g}"


def _fmt_signed(x: float) -> str:
    return f"{x:+.2f}" if abs(x) >= 0.05 or x == 0 else f"{x:+.2g}"


def _ci_text(e: Estimate) -> str:
    return f"{_fmt_signed(e.lo)}..{_fmt_signed(e.hi)}%"


def verdict(arm: str, base: str, pair: Paired) -> str:
    """One sentence on arm vs base that claims only what the paired interval supports."""
    return f"{arm}: {_verdict_body(base, pair)}"


def _verdict_body(base: str, pair: Paired) -> str:
    if pair.n == 0:
        return f"no seed in common with {base}, so no paired comparison"
    e = pair.log_loss()
    side = "below" if e.mean < 0 else "above"
    if pair.n == 1:
        return (f"1 seed: no interval, a single observation (val log-loss "
                f"{_fmt_pct(e.mean)}% {side} {base})")
    if e.excludes_zero:
        return (f"val log-loss {_fmt_pct(e.mean)}% {side} {base} (paired 95% CI "
                f"{_ci_text(e)}, {pair.n} seeds)")
    return (f"not distinguishable from {base} at this scale with {pair.n} seeds "
            f"(mean {_fmt_signed(e.mean)}%, paired 95% CI {_ci_text(e)} spans 0)")


def _pick(rows: dict[str, dict], name: str, pred) -> str | None:
    """The arm called `name`, else the only arm whose row satisfies pred."""
    if name in rows:
        return name
    hits = [a for a, r in rows.items() if pred(r)]
    return hits[0] if len(hits) == 1 else None


def _ordering(rows: dict[str, dict], by_arm: dict[str, list[Run]], baseline: str) -> dict:
    """The paper's ordering: nonlinear < linear+12.5% < linear in final val log-loss."""
    b = rows[baseline]
    nl = _pick(rows, "nonlinear", lambda r: r["query"] == "nonlinear" and not r["qk_norm"])
    wide = _pick(rows, "linear+12.5%", lambda r: r["query"] == "linear" and not r["qk_norm"]
                 and r["mlp_width"] > b["mlp_width"])
    missing = [w for w, a in (("nonlinear", nl), ("linear+12.5%", wide)) if a is None]
    if missing:
        return {"testable": False,
                "answer": f"The paper's ordering nonlinear < linear+12.5% < {baseline} cannot be "
                          f"checked here: no {' and no '.join(missing)} arm among the finished runs."}
    means = {a: rows[a]["val_loss"]["mean"] for a in (nl, wide, baseline)}
    holds = means[nl] < means[wide] < means[baseline]
    steps = [(nl, wide), (wide, baseline)]
    pairs = {f"{x} vs {y}": paired(_final(by_arm[x]), _final(by_arm[y])) for x, y in steps}
    ests = {k: p.log_loss() for k, p in pairs.items()}
    order_txt = " < ".join(f"{a} {means[a]:.4f}" for a in sorted(means, key=means.get))
    ans = (f"The paper's ordering nonlinear < linear+12.5% < {baseline} (mean final val "
           f"log-loss) {'holds' if holds else 'does not hold'} here: {order_txt}. ")
    if any(e is None for e in ests.values()):
        ans += "Some arms share no seed, so no paired interval between them."
        separated = False
    elif any(not e.has_interval for e in ests.values()):
        ans += "With 1 seed there are no intervals: the ordering rests on single observations."
        separated = False
    else:
        parts = [f"{k} {_fmt_signed(e.mean)}% (paired 95% CI {_ci_text(e)})"
                 for k, e in ests.items()]
        separated = holds and all(e.hi < 0 for e in ests.values())
        ans += "Intervals: " + "; ".join(parts) + ". "
        ans += ("Both intervals lie below 0: the intervals separate the three arms."
                if separated else "The intervals do not separate all three arms.")
    return {"testable": True, "arms": {"nonlinear": nl, "wider": wide, "baseline": baseline},
            "means": means, "holds_in_means": holds, "separated_by_intervals": separated,
            "paired": {k: p.to_dict() for k, p in pairs.items()}, "answer": ans}


def _strong_baseline(rows: dict[str, dict], by_arm: dict[str, list[Run]]) -> list[dict]:
    """For each QK-norm linear arm: does each nonlinear arm's gain survive against it?"""
    strong = [a for a, r in rows.items() if r["qk_norm"] and r["query"] == "linear"]
    nonlin = [a for a, r in rows.items() if r["query"] == "nonlinear"]
    out = []
    for s in strong:
        for n in nonlin:
            pair = paired(_final(by_arm[n]), _final(by_arm[s]))
            e = pair.log_loss()
            if e is None or not e.has_interval:
                head = "undetermined"
            elif e.hi < 0:
                head = "yes"
            else:
                head = "no"
            out.append({"nonlinear": n, "strong_baseline": s, "survives": head,
                        "paired": pair.to_dict(),
                        "answer": f"Does {n}'s gain survive against the QK-norm baseline {s}? "
                                  f"{head}: {_verdict_body(s, pair)}."})
    return out


def unigram_val_loss(data_dir: str | Path) -> float | None:
    """Val log-loss of a unigram model fitted on the train split (add-one smoothed): what a
    model that learned only token frequencies would score. None if the shards are unreadable."""
    from nlq.data.schedule import TokenData

    try:
        data = TokenData.open(data_dir)
    except NlqError:
        return None
    counts = np.bincount(data.train, minlength=data.vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    val_counts = np.bincount(data.val, minlength=data.vocab_size)[: len(logp)]
    return float(-(val_counts * logp[: len(val_counts)]).sum() / max(1, val_counts.sum()))


def _data_info(runs: list[Run]) -> dict:
    dirs = sorted({r.cfg.data.dir for r in runs})
    info = {"dirs": dirs, "meta": {}, "unigram_val_loss": {}}
    for d in dirs:
        meta = _read_json(Path(d) / "meta.json")
        info["meta"][d] = meta if isinstance(meta, dict) else None
        info["unigram_val_loss"][d] = unigram_val_loss(d) if meta else None
    return info


def summarize(runs: list[Run], baseline: str = "linear", title: str = "nlq report") -> dict:
    """The content of report.json, from collected runs."""
    done = [r for r in runs if r.finished]
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
    data = _data_info(done)
    if len(data["dirs"]) > 1:
        notes.append(f"runs used different data dirs: {', '.join(data['dirs'])}")
    b = by_arm[baseline][0].cfg if have_base else done[0].cfg
    return {
        "title": title,
        "baseline": baseline if have_base else None,
        "level": LEVEL,
        "measured": {
            "metric": "final validation log-loss (mean cross-entropy, nats per token) of each "
                      "run at its last step",
            "val_sequences": b.train.eval_batches * b.train.micro_batch,
            "block_size": b.model.block_size,
            "model": {k: getattr(b.model, k) for k in ("arch", "n_layer", "n_head", "d_model",
                                                       "block_size", "vocab_size", "pos_emb")},
            "n_finished_runs": len(done),
            "n_arms": len(rows),
        },
        "data": data,
        "arms": list(rows.values()),
        "ordering": _ordering(rows, by_arm, baseline) if have_base else None,
        "strong_baseline": _strong_baseline(rows, by_arm),
        "incomplete": [{"run_dir": str(r.dir), "arm": r.arm, "seed": r.seed,
                        "last_eval_step": r.last_step, "reason": r.problem}
                       for r in runs if not r.finished],
        "paper": PAPER,
        "notes": notes,
    }


# ---------------------------------------------------------------------------------------
# report.md


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
        return f"{_fmt_signed(e['mean'])} (1 seed, no CI)"
    return f"{_fmt_signed(e['mean'])} [{_fmt_signed(e['lo'])}, {_fmt_signed(e['hi'])}]"


def render_markdown(rep: dict, fig_name: str | None = "fig1.png") -> str:
    base = rep["baseline"]
    m = rep["measured"]
    L = [f"# {rep['title']}", ""]
    L += ["## What was measured", ""]
    mod = m["model"]
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
    L.append("")

    L += ["## Results", ""]
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
    L.append("")

    L += ["## Verdicts", ""]
    verdicts = [r["verdict"] for r in rep["arms"] if "verdict" in r]
    L += [f"- {v}." for v in verdicts] or ["- A single arm: nothing to compare."]
    if rep["ordering"]:
        L.append(f"- {rep['ordering']['answer']}")
    for s in rep["strong_baseline"]:
        L.append(f"- {s['answer']}")
    L.append("")

    if fig_name:
        L += ["## Fig. 1", "", f"![Fig. 1]({fig_name})", "",
              ("Top: validation log-loss against optimizer steps, mean over seeds (band: "
               "min..max over seeds). Bottom: improvement over the baseline, "
               "100·(L_base − L_arm)/L_base per seed paired by seed, mean over seeds (band: "
               "min..max); positive = lower loss than the baseline. Finished runs only."), ""]

    p = rep["paper"]
    L += ["## The paper's figures (another scale: not comparable one-to-one)", "",
          f"{p['cite']}; {p['setting']}.", "",
          "| version | arm | val log-loss | Δ log-loss % vs baseline | Δ perplexity % |",
          "|---|---|---|---|---|",
          (f"| v3, final | {p['v3_final']['arm']} | – | {p['v3_final']['log_loss_pct']:+.2f} | "
           f"{p['v3_final']['ppl_pct']:+.2f} |")]
    for e in p["v1_step_59k"]:
        d = "baseline" if e["log_loss_pct"] is None else f"{e['log_loss_pct']:+.2f}"
        L.append(f"| v1, step ~59k | {e['arm']} | {e['val_loss']:.3f} | {d} | – |")
    L.append("")

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


# ---------------------------------------------------------------------------------------
# Fig. 1


def _curve(runs: list[Run], value) -> tuple[list[int], list[list[float]]]:
    """Steps logged by every run, and per step the values value(run, step) over runs."""
    tables = [dict(r.evals) for r in runs if r.evals]
    if not tables:
        return [], []
    steps = sorted(set.intersection(*(set(t) for t in tables)))
    return steps, [[value(t, s) for t in tables] for s in steps]


def draw_fig1(runs: list[Run], rep: dict, path: Path) -> None:
    """Fig. 1 drawn straight onto an Agg canvas: no pyplot, so no global backend change."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base = rep["baseline"]
    by_arm: dict[str, list[Run]] = {}
    for r in runs:
        if r.finished:
            by_arm.setdefault(r.arm, []).append(r)
    arms = [row["arm"] for row in rep["arms"]]
    fig = Figure(figsize=(8, 8.5))
    FigureCanvasAgg(fig)
    top, bot = fig.subplots(2, 1, sharex=True)
    colors = [f"C{i % 10}" for i in range(len(arms))]
    late_top, late_bot, last = [], [], 0

    for arm, color in zip(arms, colors):
        steps, vals = _curve(by_arm[arm], lambda t, s: t[s])
        if not steps:
            continue
        last = max(last, steps[-1])
        mean = [sum(v) / len(v) for v in vals]
        n = len(vals[0])
        top.plot(steps, mean, color=color, label=f"{arm} ({n} seed{'s' if n > 1 else ''})")
        if n > 1:
            top.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals],
                             color=color, alpha=0.2, linewidth=0)
        late_top.append((steps, [min(v) for v in vals], [max(v) for v in vals]))

        if base is None or arm == base:
            continue
        base_by_seed = {r.seed: dict(r.evals) for r in by_arm[base] if r.evals}
        pairs = [(dict(r.evals), base_by_seed[r.seed]) for r in by_arm[arm]
                 if r.evals and r.seed in base_by_seed]
        if not pairs:
            continue
        common = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs)))
        imp = [[100.0 * (b[s] - a[s]) / b[s] for a, b in pairs] for s in common]
        bot.plot(common, [sum(v) / len(v) for v in imp], color=color,
                 label=f"{arm} ({len(pairs)} paired seed{'s' if len(pairs) > 1 else ''})")
        if len(pairs) > 1:
            bot.fill_between(common, [min(v) for v in imp], [max(v) for v in imp],
                             color=color, alpha=0.2, linewidth=0)
        late_bot.append((common, [min(v) for v in imp], [max(v) for v in imp]))

    # The first evals (loss near ln(vocab)) would flatten every later difference: scale the
    # y-axes to the last 80% of training; the lines themselves are drawn in full.
    for ax, curves in ((top, late_top), (bot, late_bot)):
        lo = [x for st, mn, _ in curves for s, x in zip(st, mn) if s >= 0.2 * last]
        hi = [x for st, _, mx in curves for s, x in zip(st, mx) if s >= 0.2 * last]
        if ax is bot:
            lo, hi = lo + [0.0], hi + [0.0]
        if lo and hi:
            pad = 0.08 * (max(hi) - min(lo) or 1.0)
            ax.set_ylim(min(lo) - pad, max(hi) + pad)
    bot.axhline(0.0, color="0.4", linewidth=0.8)
    top.set_ylabel("validation log-loss (nats/token)")
    top.set_title("validation log-loss (mean over seeds; band: min..max)", fontsize=10)
    bot.set_ylabel(f"improvement over {base} (%)\n100·(L_base − L_arm)/L_base, > 0 = better"
                   if base else "no baseline")
    bot.set_title("improvement over the baseline, paired by seed (mean; band: min..max)",
                  fontsize=10)
    bot.set_xlabel("optimizer step")
    for ax in (top, bot):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(rep["title"])
    p = rep["paper"]
    v1 = {e["arm"]: e["log_loss_pct"] for e in p["v1_step_59k"]}
    fig.text(0.01, 0.005,
             "Paper, another scale: Karbevski 2026 (arXiv 2603.13381), GPT-3 small, OpenWebText, "
             "~29.5B tokens, 1 seed per arm.\n"
             f"Final (v3): nonlinear {-p['v3_final']['log_loss_pct']:.2f}% lower val log-loss, "
             f"{-p['v3_final']['ppl_pct']:.2f}% lower perplexity.\nStep ~59k (v1): linear+12.5% "
             f"{-v1['linear+12.5%']:.2f}%, nonlinear {-v1['nonlinear']:.2f}%, tuned nonlinear "
             f"{-v1['nonlinear, tuned lr/wd']:.2f}% lower val log-loss.",
             fontsize=7.5, va="bottom", color="0.25")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------


def build_report(runs: Sequence[str | Path] | Sequence[Run], out_dir: str | Path,
                 baseline: str = "linear", title: str = "nlq report") -> dict:
    """Write report.md, report.json and fig1.png into out_dir; return report.json's content.
    runs: run/experiment folders, or the output of collect()."""
    runs = list(runs)
    if not runs:
        raise NlqError("no run dirs given")
    if not all(isinstance(r, Run) for r in runs):
        runs = collect(runs)
    rep = summarize(runs, baseline=baseline, title=title)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    draw_fig1(runs, rep, out / "fig1.png")
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_markdown(rep), encoding="utf-8")
    return rep
